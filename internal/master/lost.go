package master

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// lostLoop marks failed the running and paused sandboxes of a node that
// has sent no heartbeat for nodes.lost_after (a lost host: its
// machine died, or the network to it did): the catalog and the E2B API
// stop calling them running, with an event saying why. A paused sandbox
// whose snapshot was exported as it paused (store.export_on_pause) is
// left paused instead, with an event: its next resume (connect, the
// route's auto-resume) starts it on another node from that snapshot
// (restoreElsewhere). It runs under the loops' lease. A node heard from again is reconciled at its
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
				if sb.State == catalog.StatePaused && sb.PauseSnapshot != "" {
					if _, noted := s.lostNoted.LoadOrStore(sb.ID+"@"+last.String(), true); !noted {
						s.event(sb.ID, "warn", reason+"; the sandbox resumes on another node from the snapshot exported as it paused",
							map[string]string{"node": id, "snapshot": sb.PauseSnapshot})
					}
					continue
				}
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

// nodeLost reports whether nodeID has been silent for nodes.lost_after
// (or is not registered at all).
func (s *Service) nodeLost(nodeID string) bool {
	s.reg.mu.Lock()
	defer s.reg.mu.Unlock()
	ns := s.reg.nodes[nodeID]
	return ns == nil || time.Since(ns.lastSeen) > s.cfg.Nodes.LostAfter.Duration
}

// exportPaused snapshots a sandbox that has just paused and exports the
// snapshot to the object store, recording it as the sandbox's
// PauseSnapshot (the one it replaces is deleted from the store); the
// node's copy goes (the store's is the one that outlives the node). The
// caller holds the sandbox's lock. A failure leaves the sandbox paused
// without one (its node's loss then fails it), with an event saying so.
func (s *Service) exportPaused(ctx context.Context, sb *catalog.Sandbox) {
	begin := time.Now()
	fail := func(step string, err error) {
		s.log.Warn("export at pause failed; the sandbox is paused on its node only", "sandbox_id", sb.ID, "node_id", sb.NodeID, "step", step, "err", err)
		s.event(sb.ID, "warn", "export at pause failed ("+step+"): "+err.Error(), map[string]string{"node": sb.NodeID})
	}
	snap, err := s.snapshot(ctx, sb, "", true)
	if err != nil {
		fail("snapshot", err)
		return
	}
	defer s.forking.Delete(snap.ID)
	// The node's copy and the catalog row go; the store keeps its copy
	// (a fork-labelled snapshot is never deleted from the store here).
	defer s.dropForkSnapshot(ctx, snap)
	c, err := s.client(sb.NodeID)
	if err != nil {
		fail("export", err)
		return
	}
	resp, err := c.ExportSnapshot(ctx, &cubeletpb.ExportSnapshotRequest{SnapshotId: snap.ID})
	if err != nil {
		fail("export", fromGRPC(sb.NodeID, err))
		return
	}
	old := ""
	if _, err := s.cat.UpdateSandbox(ctx, sb.ID, func(r *catalog.Sandbox) error {
		old, r.PauseSnapshot = r.PauseSnapshot, snap.ID
		return nil
	}); err != nil {
		s.dropExported(ctx, snap.ID, sb.NodeID)
		fail("record", err)
		return
	}
	if old != "" && old != snap.ID {
		s.dropExported(ctx, old, sb.NodeID)
	}
	tr := resp.GetTransfer()
	s.log.Info("paused sandbox exported", "sandbox_id", sb.ID, "snapshot_id", snap.ID, "node_id", sb.NodeID,
		"memory", snap.HasMemory, "logical_bytes", tr.GetLogicalBytes(), "sent_bytes", tr.GetMovedBytes(), "duration", time.Since(begin))
	s.event(sb.ID, "info", "snapshot exported at pause", map[string]string{"snapshot": snap.ID, "memory": fmt.Sprint(snap.HasMemory),
		"sent_bytes": fmt.Sprint(tr.GetMovedBytes()), "duration": time.Since(begin).Round(time.Millisecond).String()})
}

// restoreElsewhere resumes a paused sandbox whose node is lost on another
// node from the snapshot its node exported as it paused (PauseSnapshot):
// same ID and token, so the same URL through the route; its state is the
// pause's. The lost node's copy is destroyed when the node reports again
// (reconcile: movedAway). The caller holds the sandbox's lock.
func (s *Service) restoreElsewhere(ctx context.Context, sb *catalog.Sandbox, timeout time.Duration) (*catalog.Sandbox, error) {
	unmark, err := s.markMoving(ctx, sb.ID)
	if err != nil {
		return nil, err
	}
	defer unmark()
	if cur, err := s.cat.GetSandbox(ctx, sb.ID); err != nil {
		return nil, err
	} else if cur.NodeID != sb.NodeID || cur.State != catalog.StatePaused {
		// Another replica restored (or moved) it meanwhile.
		if cur.State == catalog.StateRunning {
			return cur, nil
		}
		return nil, fmt.Errorf("sandbox %s is %s on node %s now: %w", sb.ID, cur.State, cur.NodeID, errdefs.ErrFailedPrecondition)
	}
	begin := time.Now()
	snap := &catalog.Snapshot{ID: sb.PauseSnapshot, SandboxID: sb.ID, NodeID: sb.NodeID, TemplateID: sb.TemplateID,
		Runtime: sb.Runtime, Team: sb.Team, EnvdAccessToken: sb.EnvdAccessToken}
	up, tidy, err := s.startElsewhere(ctx, sb, snap, time.Now().UTC().Add(timeout))
	if err != nil {
		return nil, fmt.Errorf("node %s of sandbox %s is lost, and resuming it on another node from the snapshot exported as it paused failed: %w", sb.NodeID, sb.ID, err)
	}
	s.tidyAfterMove(sb.ID, tidy, func() { s.dropExported(context.Background(), snap.ID, up.NodeID) })
	s.log.Info("sandbox restored on another node after its node was lost", "sandbox_id", sb.ID, "lost", sb.NodeID, "to", up.NodeID,
		"snapshot_id", snap.ID, "duration", time.Since(begin))
	s.event(sb.ID, "info", "sandbox resumed on another node: its node was lost", map[string]string{"from": sb.NodeID, "to": up.NodeID, "snapshot": snap.ID})
	return up, nil
}
