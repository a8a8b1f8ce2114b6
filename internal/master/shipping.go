package master

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// Snapshots across nodes. Nodes move snapshot files through the object
// store of their own [store] config (cubelet ExportSnapshot and
// ImportSnapshot); the master decides when. With store.export_snapshots a
// snapshot taken through the master is exported as soon as it is taken,
// so it outlives its node. A create from a snapshot whose node cannot take
// it (unhealthy, cordoned, or refusing the clone for lack of room) imports
// the snapshot on another node with the snapshot's runtime and template,
// clones there, and deletes the imported copy: the clone's disk is its
// own, and the catalog keeps one home for the snapshot, its original node.

// exportSnapshot uploads snap from its node to the store, when configured.
func (s *Service) exportSnapshot(ctx context.Context, snap *catalog.Snapshot) error {
	if !s.cfg.Store.ExportSnapshots {
		return nil
	}
	c, err := s.client(snap.NodeID)
	if err != nil {
		return err
	}
	start := time.Now()
	resp, err := c.ExportSnapshot(ctx, &cubeletpb.ExportSnapshotRequest{SnapshotId: snap.ID})
	if err != nil {
		return fromGRPC(snap.NodeID, err)
	}
	tr := resp.GetTransfer()
	s.log.Info("snapshot exported", "snapshot_id", snap.ID, "node", snap.NodeID, "logical_bytes", tr.GetLogicalBytes(),
		"sent_bytes", tr.GetMovedBytes(), "duration", time.Since(start))
	return nil
}

// snapshotHomeUsable reports whether snap's own node can clone it now.
func (s *Service) snapshotHomeUsable(snap *catalog.Snapshot) bool {
	for _, n := range s.schedNodes() {
		if n.ID == snap.NodeID {
			return n.Healthy && n.Schedulable
		}
	}
	return false
}

// importElsewhere imports snap from the store onto a healthy, schedulable
// node other than its own that has its runtime and template, trying them
// in the scheduler's order; it returns the node. The import is refused
// (FAILED_PRECONDITION, naming why) where a memory image cannot be
// restored; such a node is skipped.
func (s *Service) importElsewhere(ctx context.Context, snap *catalog.Snapshot) (string, error) {
	var errs []error
	for _, n := range s.schedNodes() {
		if n.ID == snap.NodeID || !n.Healthy || !n.Schedulable || !n.Templates[snap.TemplateID] ||
			(snap.Runtime != "" && !slices.Contains(n.Runtimes, snap.Runtime)) {
			continue
		}
		c, err := s.client(n.ID)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		start := time.Now()
		resp, err := c.ImportSnapshot(ctx, &cubeletpb.ImportSnapshotRequest{SnapshotId: snap.ID})
		if err != nil {
			err = fromGRPC(n.ID, err)
			if errdefs.IsNotFound(err) {
				return "", fmt.Errorf("snapshot %s was never exported to the object store: %w", snap.ID, err)
			}
			errs = append(errs, fmt.Errorf("node %s: %w", n.ID, err))
			continue
		}
		s.log.Info("snapshot imported on another node", "snapshot_id", snap.ID, "from", snap.NodeID, "to", n.ID,
			"received_bytes", resp.GetTransfer().GetMovedBytes(), "duration", time.Since(start))
		return n.ID, nil
	}
	if len(errs) == 0 {
		return "", fmt.Errorf("no other healthy node has runtime %q and template %s for snapshot %s: %w", snap.Runtime, snap.TemplateID, snap.ID, errdefs.ErrUnavailable)
	}
	return "", fmt.Errorf("snapshot %s could not be imported on another node: %w", snap.ID, errors.Join(errs...))
}

// createFromSnapshotElsewhere clones sb from snap on another node.
func (s *Service) createFromSnapshotElsewhere(ctx context.Context, sb *catalog.Sandbox, snap *catalog.Snapshot, env map[string]string) (*catalog.Sandbox, error) {
	nodeID, err := s.importElsewhere(ctx, snap)
	if err != nil {
		return nil, err
	}
	moved := *snap
	moved.NodeID = nodeID
	sb.NodeID = nodeID
	if sb.Runtime == "" {
		sb.Runtime = snap.Runtime
	}
	res := s.cloneOnto(ctx, &moved, []*catalog.Sandbox{sb}, env)
	// The clone's disk is its own: the imported copy goes.
	if c, err := s.client(nodeID); err == nil {
		if _, err := c.DeleteSnapshot(context.WithoutCancel(ctx), &cubeletpb.DeleteSnapshotRequest{SnapshotId: snap.ID}); err != nil {
			s.log.Warn("delete imported snapshot copy", "snapshot_id", snap.ID, "node", nodeID, "err", err)
		}
	}
	return res[0].Sandbox, res[0].Err
}

// resumeElsewhere resumes a paused sandbox whose node is cordoned (healthy,
// taking nothing new) on another node, keeping its ID (and so its URL
// through the route) and, where the runtime has memory snapshots and the
// nodes share a memory fingerprint, its memory: its node snapshots it
// (the fork-labelled kind, so reconcile removes one a crash leaves) and
// exports the snapshot, another node imports it and clones it under the
// sandbox's own ID and token, then the catalog moves the sandbox and the
// original is destroyed. Until the catalog moves it, any failure leaves
// the sandbox paused where it was.
func (s *Service) resumeElsewhere(ctx context.Context, sb *catalog.Sandbox, timeout time.Duration) (*catalog.Sandbox, error) {
	from := sb.NodeID
	snap, err := s.snapshot(ctx, sb, "", true)
	if err != nil {
		return nil, fmt.Errorf("move sandbox %s off node %s: snapshot: %w", sb.ID, from, err)
	}
	defer s.forking.Delete(snap.ID)
	defer s.dropForkSnapshot(ctx, snap)
	c, err := s.client(from)
	if err != nil {
		return nil, err
	}
	begin := time.Now()
	if _, err := c.ExportSnapshot(ctx, &cubeletpb.ExportSnapshotRequest{SnapshotId: snap.ID}); err != nil {
		return nil, fmt.Errorf("move sandbox %s off node %s: export: %w", sb.ID, from, fromGRPC(from, err))
	}
	exported := time.Since(begin)
	// The move's snapshot goes from the store whatever happens next (the
	// node's copy with it; dropForkSnapshot then finds it gone).
	defer func() {
		if _, err := c.DeleteSnapshot(context.WithoutCancel(ctx), &cubeletpb.DeleteSnapshotRequest{SnapshotId: snap.ID, DeleteExported: true}); err != nil {
			s.log.Warn("delete a move's snapshot from the store", "snapshot_id", snap.ID, "node", from, "err", err)
		}
	}()
	to, err := s.importElsewhere(ctx, snap)
	if err != nil {
		return nil, fmt.Errorf("move sandbox %s off node %s: %w", sb.ID, from, err)
	}
	tc, err := s.client(to)
	if err != nil {
		return nil, err
	}
	defer func() {
		if _, err := tc.DeleteSnapshot(context.WithoutCancel(ctx), &cubeletpb.DeleteSnapshotRequest{SnapshotId: snap.ID}); err != nil {
			s.log.Warn("delete imported snapshot copy", "snapshot_id", snap.ID, "node", to, "err", err)
		}
	}()
	s.creating.Store(sb.ID, true) // reconcile leaves the new copy alone
	defer s.creating.Delete(sb.ID)
	var tokens []string
	if sb.EnvdAccessToken != "" {
		tokens = []string{sb.EnvdAccessToken}
	}
	netPolicy, err := s.nodeNetwork(ctx, sb.Team, sb.Network)
	if err != nil {
		return nil, err
	}
	resp, err := tc.CloneSandbox(ctx, &cubeletpb.CloneSandboxRequest{
		RequestId: sb.ID, SnapshotId: snap.ID, Count: 1, SandboxIds: []string{sb.ID},
		Labels: managedLabels(sb), Network: netPolicy, AccessTokens: tokens,
	})
	if err == nil && len(resp.GetSandboxes()) != 1 {
		err = fmt.Errorf("node %s did not start the sandbox: %w", to, errdefs.ErrInternal)
	}
	if err != nil {
		err = fromGRPC(to, err)
		if maybeCreated(err) {
			s.destroyOn(to, sb.ID)
		}
		return nil, fmt.Errorf("move sandbox %s to node %s: %w", sb.ID, to, err)
	}
	moved := *sb
	moved.NodeID = to
	if err := s.initAgent(ctx, &moved, resp.Sandboxes[0], nil); err != nil {
		s.destroyOn(to, sb.ID)
		return nil, fmt.Errorf("move sandbox %s to node %s: agent: %w", sb.ID, to, err)
	}
	up, err := s.cat.UpdateSandbox(ctx, sb.ID, func(r *catalog.Sandbox) error {
		r.NodeID, r.State, r.EndAt = to, catalog.StateRunning, time.Now().UTC().Add(timeout)
		return nil
	})
	if err != nil {
		s.destroyOn(to, sb.ID)
		return nil, err
	}
	s.destroyOn(from, sb.ID)
	s.routes.drop(sb.ID)
	s.activity.touch(sb.ID, time.Now())
	s.log.Info("sandbox resumed on another node", "sandbox_id", sb.ID, "from", from, "to", to,
		"export", exported, "total", time.Since(begin))
	s.event(sb.ID, "info", "sandbox resumed on another node", map[string]string{"from": from, "to": to, "timeout": timeout.String()})
	return up, nil
}

// nodeCordoned reports whether nodeID is healthy but takes nothing new: a
// paused sandbox there resumes on another node.
func (s *Service) nodeCordoned(nodeID string) bool {
	for _, n := range s.schedNodes() {
		if n.ID == nodeID {
			return n.Healthy && !n.Schedulable
		}
	}
	return false
}
