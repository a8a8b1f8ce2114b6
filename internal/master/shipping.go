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
