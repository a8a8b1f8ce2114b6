package master

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// lostLoop marks failed the running and paused sandboxes of a node that
// has sent no heartbeat for nodes.lost_after (a lost host: its
// machine died, or the network to it did): the catalog and the E2B API
// stop calling them running, with an event saying why. It runs under the
// loops' lease. A node heard from again is reconciled at its
// registration, which sets the rows of the sandboxes it still runs back
// to their state there, so a partition that heals loses nothing.
//
// Silence counts from the later of the node's last heartbeat and the
// start of this loop: a replica that takes the lease (or a lone master
// that restarts) gives every node a full window to report to it first,
// rather than judging by reports that stopped while no master listened.
func (s *Service) lostLoop(ctx context.Context) {
	window := s.cfg.Nodes.LostAfter.Duration
	tick := time.NewTicker(max(window/4, 50*time.Millisecond))
	defer tick.Stop()
	begin := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		for id, last := range s.silentNodes(begin, window) {
			if err := s.fence(ctx); err != nil {
				return
			}
			rows, _, err := s.cat.ListSandboxes(ctx, catalog.Query{NodeID: id, States: []string{catalog.StateRunning, catalog.StatePaused}})
			if err != nil {
				if ctx.Err() == nil {
					s.log.Error("lost nodes: list sandboxes", "node_id", id, "err", err)
				}
				continue
			}
			reason := fmt.Sprintf("node %s lost: no heartbeat since %s", id, last.UTC().Format(time.RFC3339))
			for _, sb := range rows {
				s.markFailed(ctx, id, &masterpb.DeadSandbox{SandboxId: sb.ID, Reason: reason, DiedAt: timestamppb.New(last)})
			}
		}
	}
}

// silentNodes returns the nodes silent for longer than window, counted
// from no earlier than begin, with their last heartbeat.
func (s *Service) silentNodes(begin time.Time, window time.Duration) map[string]time.Time {
	now := time.Now()
	s.reg.mu.Lock()
	defer s.reg.mu.Unlock()
	out := map[string]time.Time{}
	for id, ns := range s.reg.nodes {
		if now.Sub(ns.lastSeen) > window && now.Sub(begin) > window {
			out[id] = ns.lastSeen
		}
	}
	return out
}
