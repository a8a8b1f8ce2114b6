package cubelet

import (
	"context"
	"strings"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet/health"
	"github.com/cubesandbox/cube/internal/runtime"
)

// Health probes run every healthInterval; a condition fails (the node is
// unhealthy, the master places nothing there) only after healthThreshold
// failed probes in a row. A failure short of that makes the node busy.
const (
	healthInterval  = time.Second
	healthThreshold = 3
	probeTimeout    = 2 * time.Second
)

// Condition is one health check.
type Condition = health.Condition

// Health returns the conditions of the last probe round: ok is false when
// one of them has failed persistently.
func (s *Service) Health(context.Context) (bool, []Condition) {
	conds := s.health.Last()
	ok, _ := health.Summary(conds)
	return ok, conds
}

func (s *Service) healthLoop(ctx context.Context) {
	defer close(s.healthDone)
	tick := time.NewTicker(healthInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			s.probe(ctx)
		}
	}
}

// probe runs one round of cheap checks: none lists sandboxes or waits on
// a sandbox's lock, so a burst of creates and deletes cannot fail them.
func (s *Service) probe(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	round := map[string]error{}
	_, err := s.store.Meta("node_id")
	round["store"] = err
	round["storage"] = runtime.ProbeFiles(s.node.Pool.Dir())
	for name, d := range s.node.Drivers {
		if p, ok := d.(runtime.Prober); ok {
			round["runtime/"+name] = p.Probe(ctx)
		}
	}
	if on, err := s.node.Net.Health(ctx); on {
		round["network-agent"] = err
	}
	before, _ := health.Summary(s.health.Last())
	conds := s.health.Observe(round)
	after, _ := health.Summary(conds)
	if before != after {
		if after {
			s.log.Info("node healthy")
		} else {
			var bad []string
			for _, c := range conds {
				if !c.OK {
					bad = append(bad, c.Type+": "+c.Message)
				}
			}
			s.log.Warn("node unhealthy: a condition failed persistently", "failing", strings.Join(bad, "; "))
		}
	}
}

// busy says whether the node would rather not take more sandboxes now: a
// condition failing but not yet persistently, or the create flow at its
// concurrency limit. The scheduler still places here when it must.
func (s *Service) busy(conds []Condition) (bool, string) {
	_, why := health.Summary(conds)
	if l, ok := s.engine.Limits()[FlowCreate]; ok && l.Limit > 0 && l.InFlight >= l.Limit {
		why = append(why, "create flow at its limit")
	}
	return len(why) > 0, strings.Join(why, "; ")
}
