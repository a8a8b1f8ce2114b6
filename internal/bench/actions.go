package bench

import (
	"fmt"
	"sync"
	"time"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
)

// ActionStat is the latency of one workflow action inside cubelet, from
// the timings every lifecycle RPC returns. Set against the RPC's own
// latency it shows where the time goes, and how much is outside every
// action (gRPC, validation, the state store, the engine).
type ActionStat struct {
	Action  string  `json:"action"` // flow/step/action, e.g. create/3/container
	Latency Summary `json:"latency"`
}

// actionTimes collects ActionTimings across the calls of a scenario.
type actionTimes struct {
	mu    sync.Mutex
	m     map[string][]time.Duration
	order []string
}

func (a *actionTimes) add(ts []*pb.ActionTiming) {
	if a == nil {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.m == nil {
		a.m = map[string][]time.Duration{}
	}
	for _, t := range ts {
		if t.Phase != "" && t.Phase != "do" {
			continue // undo timings belong to failed calls
		}
		k := fmt.Sprintf("%s/%d/%s", t.Flow, t.Step, t.Action)
		if _, ok := a.m[k]; !ok {
			a.order = append(a.order, k)
		}
		a.m[k] = append(a.m[k], t.Duration.AsDuration())
	}
}

// merge adds o's timings (o may be nil).
func (a *actionTimes) merge(o *actionTimes) {
	if o == nil {
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.m == nil {
		a.m = map[string][]time.Duration{}
	}
	for _, k := range o.order {
		if _, ok := a.m[k]; !ok {
			a.order = append(a.order, k)
		}
		a.m[k] = append(a.m[k], o.m[k]...)
	}
}

func (a *actionTimes) stats() []ActionStat {
	if a == nil {
		return nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []ActionStat
	for _, k := range a.order {
		out = append(out, ActionStat{Action: k, Latency: Summarize(a.m[k])})
	}
	return out
}
