package master

import (
	"context"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// dropUnplaced removes rows of creates that never reached a node (the
// master died between writing the row and picking a node). Creates in
// flight here, or possibly at another replica (createInFlight), are left.
func (s *Service) dropUnplaced(ctx context.Context) error {
	rows, _, err := s.cat.ListSandboxes(ctx, catalog.Query{States: []string{catalog.StateCreating}})
	if err != nil {
		return err
	}
	for _, sb := range rows {
		if sb.NodeID == "" && !s.createInFlight(sb) {
			s.log.Info("reconcile: dropping a create that never reached a node", "sandbox_id", sb.ID)
			if err := s.cat.DeleteSandbox(ctx, sb.ID); err != nil && !errdefs.IsNotFound(err) {
				return err
			}
		}
	}
	return nil
}

// createInFlight reports whether a row in state creating may belong to a
// create still running: in this process (creating), or, on a shared
// catalog, at another replica, which no replica can see. A create runs at
// most sandbox.create_timeout after its row is written, so a row older
// than that (and a margin for the writers' clocks) is no create's any
// more; until then it is left alone (sweepCreates comes back to it).
func (s *Service) createInFlight(sb *catalog.Sandbox) bool {
	if _, ok := s.creating.Load(sb.ID); ok {
		return true
	}
	return s.shared() && time.Since(sb.StartedAt) < s.createGrace()
}

func (s *Service) createGrace() time.Duration {
	return s.cfg.Sandbox.CreateTimeout.Duration + 10*time.Second
}

// sweepCreates (a shared catalog's leader) resolves the rows of creates
// that ended with their replica: every createGrace/2 it reconciles the
// nodes holding a row in state creating past createGrace, and drops
// unplaced ones.
func (s *Service) sweepCreates(ctx context.Context) {
	tick := time.NewTicker(max(s.createGrace()/2, time.Second))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		rows, _, err := s.cat.ListSandboxes(ctx, catalog.Query{States: []string{catalog.StateCreating}})
		if err != nil {
			continue
		}
		nodes := map[string]bool{}
		unplaced := false
		for _, sb := range rows {
			if s.createInFlight(sb) {
				continue
			}
			if sb.NodeID == "" {
				unplaced = true
			} else {
				nodes[sb.NodeID] = true
			}
		}
		if unplaced {
			if err := s.dropUnplaced(ctx); err != nil && ctx.Err() == nil {
				s.log.Warn("reconcile: drop unplaced creates", "err", err)
			}
		}
		for id := range nodes {
			if err := s.reconcileNode(ctx, id); err != nil && ctx.Err() == nil {
				s.log.Warn("reconcile: node with creates that ended with their replica", "node_id", id, "err", err)
			}
		}
	}
}

// reconcileAll reconciles every node known when the loops' lease was
// taken, retrying the ones that cannot be reached until each has been
// done once, after dropping the creates that never reached a node.
func (s *Service) reconcileAll(ctx context.Context) {
	if err := s.dropUnplaced(ctx); err != nil && ctx.Err() == nil {
		s.log.Warn("reconcile: drop unplaced creates", "err", err)
	}
	s.reg.mu.Lock()
	todo := map[string]bool{}
	for id := range s.reg.nodes {
		todo[id] = true
	}
	s.reg.mu.Unlock()
	for len(todo) > 0 {
		for id := range todo {
			if err := s.reconcileNode(ctx, id); err == nil {
				delete(todo, id)
			} else if ctx.Err() == nil {
				s.log.Debug("reconcile: node not reachable yet", "node_id", id, "err", err)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(5 * time.Second):
		}
	}
}

// differs reports whether the node's view of a sandbox (nil: it has none)
// disagrees with its catalog row.
func differs(nsb *cubeletpb.Sandbox, cur *catalog.Sandbox) bool {
	switch {
	case nsb == nil:
		return true
	case nsb.State == cubeletpb.SandboxState_SANDBOX_STATE_RUNNING:
		return cur.State != catalog.StateRunning
	case nsb.State == cubeletpb.SandboxState_SANDBOX_STATE_PAUSED:
		return cur.State != catalog.StatePaused
	}
	return false
}

// sandboxOnNode is the node's current record of sandbox id, nil when it
// has none.
func (s *Service) sandboxOnNode(ctx context.Context, c cubeletpb.CubeletServiceClient, id string) (*cubeletpb.Sandbox, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	resp, err := c.GetSandbox(ctx, &cubeletpb.GetSandboxRequest{SandboxId: id}, grpc.WaitForReady(true))
	if status.Code(err) == codes.NotFound {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return resp.Sandbox, nil
}

// reconcileNode makes the catalog agree with what a node really holds:
//
//   - a row whose sandbox the node no longer has is dropped;
//   - a row still "creating" with no create in flight here (the master
//     died mid-create, the client never got it) is destroyed and dropped;
//   - a row whose state differs from the node's (paused vs running) takes
//     the node's;
//   - a sandbox whose row names another node that holds a newer copy (it
//     moved while this node was away) is destroyed here (movedAway);
//   - a sandbox carrying the managed label with no row is destroyed when
//     the catalog has its tombstone (a kill while the node was away, an
//     undo that could not reach it) or it is older than
//     sandbox.adopt_window, and adopted (a row written from the node's
//     record) when it is younger: the catalog lost its row, and a
//     client may hold it.
//
// Sandboxes made on the node without the master (cubecli) are left alone.
func (s *Service) reconcileNode(ctx context.Context, nodeID string) error {
	if err := s.fence(ctx); err != nil {
		return err
	}
	c, err := s.client(nodeID)
	if err != nil {
		return err
	}
	lctx, lcancel := context.WithTimeout(ctx, 10*time.Second)
	defer lcancel()
	// Wait for the connection: the node may have just (re)started.
	resp, err := c.ListSandboxes(lctx, &cubeletpb.ListSandboxesRequest{}, grpc.WaitForReady(true))
	if err != nil {
		return fromGRPC(nodeID, err)
	}
	onNode := map[string]*cubeletpb.Sandbox{}
	for _, sb := range resp.Sandboxes {
		onNode[sb.Id] = sb
	}
	rows, _, err := s.cat.ListSandboxes(ctx, catalog.Query{NodeID: nodeID})
	if err != nil {
		return err
	}
	rowIDs := map[string]bool{}
	var dropped, fixed, orphans, adopted int
	now := time.Now()
	if _, err := s.cat.PruneTombstones(ctx, now.Add(-s.cfg.Sandbox.AdoptWindow.Duration)); err != nil {
		return err
	}
	for _, row := range rows {
		rowIDs[row.ID] = true
		if row.State == catalog.StateCreating && s.createInFlight(row) {
			continue
		}
		if _, inFlight := s.creating.Load(row.ID); inFlight {
			continue
		}
		unlock, err := s.locks.lock(ctx, row.ID)
		if err != nil {
			return err
		}
		// Re-read under the lock: a verb may have finished meanwhile.
		cur, err := s.cat.GetSandbox(ctx, row.ID)
		if err != nil {
			unlock()
			continue
		}
		nsb := onNode[row.ID]
		if differs(nsb, cur) {
			// The list was taken before the lock: a verb that finished
			// in between (a pause, a resume, a create) changed both the
			// node and the row. Ask the node again, under the lock.
			nsb, err = s.sandboxOnNode(ctx, c, row.ID)
			if err != nil {
				unlock()
				return fromGRPC(nodeID, err)
			}
		}
		switch {
		case nsb == nil:
			s.log.Warn("reconcile: sandbox gone from its node; dropping it", "sandbox_id", row.ID, "node_id", nodeID, "state", cur.State)
			_ = s.cat.DeleteSandbox(ctx, row.ID)
			dropped++
		case cur.State == catalog.StateCreating:
			s.log.Warn("reconcile: destroying a create the master did not finish", "sandbox_id", row.ID, "node_id", nodeID)
			s.destroyOn(nodeID, row.ID, grpc.WaitForReady(true))
			_ = s.cat.DeleteSandbox(ctx, row.ID)
			dropped++
		default:
			want := ""
			switch nsb.State {
			case cubeletpb.SandboxState_SANDBOX_STATE_RUNNING:
				want = catalog.StateRunning
			case cubeletpb.SandboxState_SANDBOX_STATE_PAUSED:
				want = catalog.StatePaused
			}
			if want != "" && want != cur.State {
				s.log.Info("reconcile: sandbox state from its node", "sandbox_id", row.ID, "catalog", cur.State, "node", want)
				if _, err := s.cat.UpdateSandbox(ctx, row.ID, func(r *catalog.Sandbox) error {
					// A resume the master died in: the node runs it, the
					// row kept the deadline of the paused sandbox, which
					// may have passed. Give it the resume's default
					// rather than let expiry kill what the node resumed.
					if want == catalog.StateRunning && r.State == catalog.StatePaused {
						r.EndAt = maxTime(r.EndAt, time.Now().UTC().Add(s.cfg.Sandbox.V1DefaultTimeout.Duration))
					}
					r.State = want
					return nil
				}); err == nil {
					fixed++
				}
			}
		}
		s.routes.drop(row.ID)
		unlock()
	}
	for id, nsb := range onNode {
		if rowIDs[id] || nsb.Labels[ManagedLabel] != ManagedValue {
			continue
		}
		if row, err := s.cat.GetSandbox(ctx, id); err == nil {
			if row.NodeID != nodeID && row.NodeID != "" && s.movedAway(ctx, nodeID, id, nsb, now) {
				orphans++
			}
			continue // placed on this node since the listing, or moved
		}
		removed, err := s.cat.Tombstoned(ctx, id)
		if err != nil {
			return err
		}
		if !removed && s.adoptable(nsb, now) {
			if _, err := s.adopt(ctx, nodeID, nsb); err != nil {
				// Neither adopted nor destroyed: the next reconcile
				// tries again.
				s.log.Error("reconcile: adopt a sandbox the catalog does not have", "sandbox_id", id, "node_id", nodeID, "err", err)
				continue
			}
			s.log.Warn("reconcile: adopted a recent managed sandbox the catalog had no row for", "sandbox_id", id, "node_id", nodeID,
				"created", nsb.CreatedAt.AsTime(), "team", nsb.Labels[teamLabel])
			adopted++
			continue
		}
		s.log.Warn("reconcile: destroying a managed sandbox the catalog does not have", "sandbox_id", id, "node_id", nodeID,
			"removed_on_purpose", removed)
		s.destroyOn(nodeID, id, grpc.WaitForReady(true))
		orphans++
	}
	snaps, err := s.reconcileSnapshots(ctx, nodeID, c)
	if err != nil {
		return err
	}
	s.log.Info("node reconciled", "node_id", nodeID, "sandboxes", len(onNode), "catalog", len(rows),
		"dropped", dropped, "state_fixed", fixed, "orphans_destroyed", orphans, "adopted", adopted, "snapshots_deleted", snaps)
	return nil
}

// movedAway destroys the node's copy of a sandbox whose row names another
// node, when that node holds a copy made after this one: the sandbox
// moved while this node was away (a drain or resume elsewhere whose
// destroy could not reach it, a restore after the node was lost). It
// reports whether it did. A move to this node in flight has it the other
// way round (this copy is the newer, the row still names the node it
// leaves) and is left: in this process it also holds the sandbox's lock
// and creating. When the row's node cannot say, nothing is done.
func (s *Service) movedAway(ctx context.Context, nodeID, id string, nsb *cubeletpb.Sandbox, now time.Time) bool {
	if _, inFlight := s.creating.Load(id); inFlight {
		return false
	}
	unlock, err := s.locks.lock(ctx, id)
	if err != nil {
		return false
	}
	defer unlock()
	row, err := s.cat.GetSandbox(ctx, id)
	if err != nil || row.NodeID == nodeID || row.NodeID == "" {
		return false
	}
	if _, inFlight := s.creating.Load(id); inFlight {
		return false
	}
	c, err := s.client(row.NodeID)
	if err != nil {
		return false
	}
	there, err := s.sandboxOnNode(ctx, c, id)
	if err != nil || there == nil || nsb.CreatedAt == nil || there.CreatedAt == nil ||
		!there.CreatedAt.AsTime().After(nsb.CreatedAt.AsTime()) {
		return false
	}
	s.log.Warn("reconcile: destroying the copy of a sandbox that moved to another node", "sandbox_id", id, "node_id", nodeID,
		"now_on", row.NodeID, "copy_created", nsb.CreatedAt.AsTime(), "there_created", there.CreatedAt.AsTime(), "age", now.Sub(nsb.CreatedAt.AsTime()))
	s.destroyOn(nodeID, id, grpc.WaitForReady(true))
	return true
}

// reconcileSnapshots deletes the node's managed snapshots nobody can use:
// those without a catalog row (the master died between the node taking
// the snapshot and writing its row), and the snapshots of forks that are
// not in flight here (the master died mid-fork; a fork's snapshot is
// never the client's). A snapshot is taken under its sandbox's lock, so
// holding that lock while re-reading the row excludes one in flight.
func (s *Service) reconcileSnapshots(ctx context.Context, nodeID string, c cubeletpb.CubeletServiceClient) (int, error) {
	lctx, lcancel := context.WithTimeout(ctx, 10*time.Second)
	resp, err := c.ListSnapshots(lctx, &cubeletpb.ListSnapshotsRequest{Labels: map[string]string{ManagedLabel: ManagedValue}}, grpc.WaitForReady(true))
	lcancel()
	if err != nil {
		return 0, fromGRPC(nodeID, err)
	}
	deleted := 0
	for _, sn := range resp.Snapshots {
		if sn.Labels[ManagedLabel] != ManagedValue {
			continue
		}
		if _, inFlight := s.forking.Load(sn.Id); inFlight {
			continue
		}
		// On a shared catalog another replica may be forking from it, or
		// be about to write its row: its forks and locks are not this
		// process's. Young snapshots are left to a later pass.
		if s.shared() && sn.CreatedAt != nil && time.Since(sn.CreatedAt.AsTime()) < s.createGrace() {
			continue
		}
		fork := sn.Labels[forkLabel] == "true"
		unlock, err := s.locks.lock(ctx, sn.SandboxId)
		if err != nil {
			return deleted, err
		}
		_, rerr := s.cat.GetSnapshot(ctx, sn.Id)
		switch {
		case rerr == nil && !fork:
		case rerr != nil && !errdefs.IsNotFound(rerr):
			s.log.Warn("reconcile: read snapshot row", "snapshot_id", sn.Id, "err", rerr)
		default:
			if _, inFlight := s.forking.Load(sn.Id); inFlight {
				break // a fork began while we waited for the lock
			}
			s.log.Warn("reconcile: deleting a snapshot nobody can use", "snapshot_id", sn.Id, "node_id", nodeID, "fork", fork, "row", rerr == nil)
			dctx, dcancel := context.WithTimeout(ctx, time.Minute)
			_, err := c.DeleteSnapshot(dctx, &cubeletpb.DeleteSnapshotRequest{SnapshotId: sn.Id})
			dcancel()
			if err := fromGRPC(nodeID, err); err != nil && !errdefs.IsNotFound(err) {
				s.log.Warn("reconcile: delete snapshot", "snapshot_id", sn.Id, "node_id", nodeID, "err", err)
			} else {
				if rerr == nil {
					_ = s.cat.DeleteSnapshot(ctx, sn.Id)
				}
				deleted++
			}
		}
		unlock()
	}
	return deleted, nil
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
