package master

import (
	"context"
	"fmt"
	"time"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/sandboxid"
)

// Snapshots live on the node that took them; the catalog records which
// node, so creates from a snapshot (Sandbox.create(snapshotID)) and forks
// go there. Runtimes without memory checkpoints take disk-only snapshots
// (their clones boot fresh from the disk); nodes that cannot snapshot at
// all answer Unimplemented, which the API reports as 501.

// Snapshot takes a persistent snapshot of a sandbox. name is optional; a
// later snapshot with the same name takes the name over.
func (s *Service) Snapshot(ctx context.Context, id, name string) (*catalog.Snapshot, error) {
	if name != "" && !templateNameRE.MatchString(name) {
		return nil, errdefs.FieldErrorf("name", "%q: 1-128 letters, digits, '.', '_', ':', '/' or '-'", name)
	}
	sb, unlock, err := s.lockSandbox(ctx, id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	return s.snapshot(ctx, sb, name, false)
}

// forkLabel marks on the node the snapshot a fork takes for its clones:
// it is deleted when the fork ends, so one left behind (the master died
// mid-fork) is deleted by reconcile.
const forkLabel = "cube.fork"

// snapshot takes a snapshot of sb; fork marks it as a fork's (forkLabel)
// and records it in s.forking until the caller removes it.
func (s *Service) snapshot(ctx context.Context, sb *catalog.Sandbox, name string, fork bool) (*catalog.Snapshot, error) {
	if sb.State != catalog.StateRunning && sb.State != catalog.StatePaused {
		return nil, fmt.Errorf("sandbox %s is %s: %w", sb.ID, sb.State, errdefs.ErrFailedPrecondition)
	}
	snapID := sandboxid.New()
	labels := map[string]string{ManagedLabel: ManagedValue}
	if fork {
		labels[forkLabel] = "true"
		s.forking.Store(snapID, true)
	}
	snap, err := s.takeSnapshot(ctx, sb, name, snapID, labels)
	if err != nil && fork {
		s.forking.Delete(snapID)
	}
	if err == nil && !fork {
		// The snapshot stands on its node even when the upload fails;
		// it then cannot move (a later create elsewhere says so).
		if xerr := s.exportSnapshot(ctx, snap); xerr != nil {
			s.log.Error("export snapshot to the object store", "snapshot_id", snap.ID, "err", xerr)
		}
	}
	return snap, err
}

func (s *Service) takeSnapshot(ctx context.Context, sb *catalog.Sandbox, name, snapID string, labels map[string]string) (*catalog.Snapshot, error) {
	if err := fpSnapshotBegin.Eval(ctx); err != nil {
		return nil, err
	}
	var resp *cubeletpb.SnapshotSandboxResponse
	err := s.onNode(ctx, sb, func(ctx context.Context, c cubeletpb.CubeletServiceClient) error {
		var err error
		resp, err = c.SnapshotSandbox(ctx, &cubeletpb.SnapshotSandboxRequest{
			RequestId: sb.ID, SandboxId: sb.ID, SnapshotId: snapID, Name: name,
			Labels: labels,
		})
		return err
	})
	if errdefs.IsNotImplemented(err) {
		return nil, fmt.Errorf("snapshots are not supported by node %s yet: %w", sb.NodeID, errdefs.ErrNotImplemented)
	}
	if err != nil {
		return nil, err
	}
	snap := &catalog.Snapshot{
		ID: resp.Snapshot.GetId(), Name: name, SandboxID: sb.ID, NodeID: sb.NodeID, TemplateID: sb.TemplateID,
		HasMemory: resp.Snapshot.GetHasMemory(), EnvdAccessToken: sb.EnvdAccessToken, CreatedAt: time.Now().UTC(),
		Runtime: resp.Snapshot.GetRuntime(), Team: sb.Team,
	}
	if snap.Runtime == "" {
		snap.Runtime = sb.Runtime
	}
	if snap.ID == "" {
		snap.ID = snapID
	}
	err = fpSnapshotTaken.Eval(ctx)
	if err == nil {
		err = s.cat.CreateSnapshot(ctx, snap)
	}
	if err != nil {
		// Without a row nobody could find it: remove it from the node.
		_ = s.onNode(context.WithoutCancel(ctx), sb, func(ctx context.Context, c cubeletpb.CubeletServiceClient) error {
			_, err := c.DeleteSnapshot(ctx, &cubeletpb.DeleteSnapshotRequest{SnapshotId: snap.ID})
			return err
		})
		return nil, err
	}
	if err := fpSnapshotDone.Eval(ctx); err != nil {
		return nil, err
	}
	s.event(sb.ID, "info", "snapshot taken", map[string]string{"snapshot": snap.ID, "memory": fmt.Sprint(snap.HasMemory)})
	return snap, nil
}

// ListSnapshots returns a page of snapshots.
func (s *Service) ListSnapshots(ctx context.Context, q catalog.SnapshotQuery) ([]*catalog.Snapshot, string, error) {
	if t := TeamOf(ctx); t != "" {
		q.Team = t
	}
	return s.cat.ListSnapshots(ctx, q)
}

// DeleteSnapshot deletes a snapshot from its node and the catalog.
func (s *Service) DeleteSnapshot(ctx context.Context, idOrName string) error {
	snap, err := s.cat.GetTeamSnapshot(ctx, TeamOf(ctx), idOrName)
	if err != nil {
		return err
	}
	c, err := s.client(snap.NodeID)
	if err == nil {
		// Exported ones (store.export_snapshots) go from the store too.
		_, err = c.DeleteSnapshot(ctx, &cubeletpb.DeleteSnapshotRequest{SnapshotId: snap.ID, DeleteExported: s.cfg.Store.ExportSnapshots && !isForkSnapshot(s, snap.ID)})
		err = fromGRPC(snap.NodeID, err)
	}
	if err != nil && !errdefs.IsNotFound(err) {
		return err
	}
	return s.cat.DeleteSnapshot(ctx, snap.ID)
}

// ForkResult is one fork: the new sandbox, or why it did not start.
type ForkResult struct {
	Sandbox *catalog.Sandbox
	Err     error
}

// Fork snapshots a running sandbox in place (it keeps its ID and deadline)
// and starts count new sandboxes from the snapshot on the same node.
// Each fork succeeds or fails on its own.
func (s *Service) Fork(ctx context.Context, id string, count int, timeout time.Duration) ([]ForkResult, error) {
	if count == 0 {
		count = 1
	}
	if count < 1 || count > 100 {
		return nil, errdefs.FieldErrorf("count", "%d: want 1-100", count)
	}
	if timeout == 0 {
		timeout = s.cfg.Sandbox.V1DefaultTimeout.Duration
	}
	if err := s.validateTimeout("timeout", timeout); err != nil {
		return nil, err
	}
	src, unlock, err := s.lockSandbox(ctx, id)
	if err != nil {
		return nil, err
	}
	if src.State != catalog.StateRunning {
		unlock()
		return nil, fmt.Errorf("sandbox %s is %s; only a running sandbox can be forked: %w", id, src.State, errdefs.ErrFailedPrecondition)
	}
	snap, err := s.snapshot(ctx, src, "", true)
	unlock()
	if err != nil {
		return nil, err
	}
	defer s.forking.Delete(snap.ID)
	if err := fpForkSnapshotted.Eval(ctx); err != nil {
		s.dropForkSnapshot(ctx, snap)
		return nil, err
	}
	children := make([]*catalog.Sandbox, count)
	for i := range children {
		children[i] = s.childOf(src, snap, timeout)
	}
	out := s.cloneOnto(ctx, snap, children, nil)
	s.dropForkSnapshot(ctx, snap)
	if err := fpForkDone.Eval(ctx); err != nil {
		return nil, err
	}
	return out, nil
}

// dropForkSnapshot deletes a fork's snapshot: the clones are independent
// copies, and the snapshot is not the client's to see. One that cannot be
// deleted now is deleted by the node's next reconcile (forkLabel).
func (s *Service) dropForkSnapshot(ctx context.Context, snap *catalog.Snapshot) {
	if err := s.DeleteSnapshot(context.WithoutCancel(ctx), snap.ID); err != nil {
		s.log.Warn("fork: could not delete its snapshot; it stays listed", "snapshot_id", snap.ID, "err", err)
	}
}

// childOf is the row of a new sandbox cloned from snap, inheriting the
// source's settings.
func (s *Service) childOf(src *catalog.Sandbox, snap *catalog.Snapshot, timeout time.Duration) *catalog.Sandbox {
	now := time.Now().UTC()
	c := &catalog.Sandbox{
		ID: sandboxid.New(), TemplateID: snap.TemplateID, Alias: snap.Name, NodeID: snap.NodeID, State: catalog.StateCreating,
		MilliCPU: s.cfg.Sandbox.MilliCPU, MemoryMiB: s.cfg.Sandbox.MemoryMiB, StartedAt: now, EndAt: now.Add(timeout),
		Runtime: snap.Runtime, Team: snap.Team,
	}
	if src != nil {
		c.AutoPause, c.AutoResume, c.Network, c.APIKeyID = src.AutoPause, src.AutoResume, src.Network, src.APIKeyID
		c.Metadata = src.Metadata
		if src.EnvdAccessToken != "" {
			c.EnvdAccessToken = token()
		}
		if src.TrafficAccessToken != "" {
			c.TrafficAccessToken = token()
		}
	}
	return c
}

// createFromSnapshot is Create when the template named a snapshot.
func (s *Service) createFromSnapshot(ctx context.Context, sb *catalog.Sandbox, snap *catalog.Snapshot, env map[string]string) (*catalog.Sandbox, error) {
	if !s.snapshotHomeUsable(snap) {
		sb2, err := s.createFromSnapshotElsewhere(ctx, sb, snap, env)
		if err != nil {
			return nil, fmt.Errorf("snapshot %s is on node %s, which is unhealthy or cordoned, and moving it failed: %w", snap.ID, snap.NodeID, err)
		}
		return sb2, nil
	}
	sb.NodeID = snap.NodeID
	if sb.Runtime == "" {
		sb.Runtime = snap.Runtime
	}
	res := s.cloneOnto(ctx, snap, []*catalog.Sandbox{sb}, env)
	return res[0].Sandbox, res[0].Err
}

// cloneOnto creates the given rows as clones of snap on its node: rows
// first, then one CloneSandbox call, then each agent is initialised with
// its own token.
func (s *Service) cloneOnto(ctx context.Context, snap *catalog.Snapshot, rows []*catalog.Sandbox, env map[string]string) []ForkResult {
	out := make([]ForkResult, len(rows))
	fail := func(i int, err error) {
		out[i].Err = err
		s.forgetFailed(rows[i].ID)
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.Sandbox.CreateTimeout.Duration)
	defer cancel()
	ids := make([]string, 0, len(rows))
	var written []int
	for i, r := range rows {
		if err := s.cat.CreateSandbox(ctx, r); err != nil {
			out[i].Err = err
			continue
		}
		s.creating.Store(r.ID, true)
		ids = append(ids, r.ID)
		written = append(written, i)
	}
	defer func() {
		for _, id := range ids {
			s.creating.Delete(id)
		}
	}()
	if len(ids) == 0 {
		return out
	}
	if err := fpCloneRows.Eval(ctx); err != nil {
		for _, i := range written {
			fail(i, err)
		}
		return out
	}
	c, err := s.client(snap.NodeID)
	var resp *cubeletpb.CloneSandboxResponse
	if err == nil {
		s.awaitNode(ctx, snap.NodeID) // its cubelet may be restarting
		// Each clone's own token: the node gives it to the clone's agent
		// (its reinit, for one restored from memory) before returning it,
		// so no clone answers the snapshot's token any more.
		var tokens []string
		for _, i := range written {
			if rows[i].EnvdAccessToken != "" {
				tokens = make([]string, 0, len(written))
				break
			}
		}
		if tokens != nil {
			for _, i := range written {
				tokens = append(tokens, rows[i].EnvdAccessToken)
			}
		}
		var netPolicy *cubeletpb.NetworkPolicy
		netPolicy, err = s.nodeNetwork(ctx, rows[written[0]].Team, rows[written[0]].Network)
		if err == nil {
			resp, err = c.CloneSandbox(ctx, &cubeletpb.CloneSandboxRequest{
				RequestId: ids[0], SnapshotId: snap.ID, Count: int32(len(ids)), SandboxIds: ids,
				Labels: managedLabels(rows[written[0]]), Env: env, Network: netPolicy,
				AccessTokens: tokens,
			})
			err = fromGRPC(snap.NodeID, err)
		}
	}
	if err == nil {
		if err = fpCloneMade.Eval(ctx); err != nil {
			for _, id := range ids {
				s.destroyOn(snap.NodeID, id)
			}
		}
	}
	if errdefs.IsNotImplemented(err) {
		err = fmt.Errorf("creating sandboxes from snapshots is not supported by node %s yet: %w", snap.NodeID, errdefs.ErrNotImplemented)
	}
	if err != nil {
		if maybeCreated(err) {
			for _, id := range ids {
				s.destroyOn(snap.NodeID, id)
			}
		}
		for _, i := range written {
			fail(i, err)
		}
		return out
	}
	made := map[string]*cubeletpb.Sandbox{}
	for _, pb := range resp.Sandboxes {
		made[pb.Id] = pb
	}
	for _, i := range written {
		r := rows[i]
		pb := made[r.ID]
		if pb == nil {
			fail(i, fmt.Errorf("node %s did not start clone %s: %w", snap.NodeID, r.ID, errdefs.ErrInternal))
			continue
		}
		if err := s.initAgent(ctx, r, pb, env); err != nil {
			s.destroyOn(snap.NodeID, r.ID)
			fail(i, err)
			continue
		}
		timeout := r.EndAt.Sub(r.StartedAt)
		up, err := s.cat.UpdateSandbox(ctx, r.ID, func(x *catalog.Sandbox) error {
			x.State, x.EnvdVersion = catalog.StateRunning, r.EnvdVersion
			if rt := pb.GetRuntime(); rt != "" {
				x.Runtime = rt
			}
			x.StartedAt = time.Now().UTC()
			x.EndAt = x.StartedAt.Add(timeout)
			return nil
		})
		if err != nil {
			s.destroyOn(snap.NodeID, r.ID)
			fail(i, err)
			continue
		}
		out[i].Sandbox = up
		s.event(r.ID, "info", "sandbox created from snapshot", map[string]string{"node": snap.NodeID, "snapshot": snap.ID})
	}
	if err := fpCloneDone.Eval(ctx); err != nil {
		for i := range out {
			if out[i].Sandbox != nil {
				s.destroyOn(snap.NodeID, out[i].Sandbox.ID)
				out[i].Sandbox = nil
				fail(i, err)
			}
		}
	}
	return out
}

// isForkSnapshot reports whether id is a fork's (or a move's) snapshot in
// flight: never exported by store.export_snapshots.
func isForkSnapshot(s *Service, id string) bool {
	_, ok := s.forking.Load(id)
	return ok
}
