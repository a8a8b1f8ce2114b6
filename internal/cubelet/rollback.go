package cubelet

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/cubesandbox/cube/internal/cubelet/actions"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// RollbackRequest asks to put a sandbox back to one of its template's
// snapshots.
type RollbackRequest struct {
	RequestID  string
	SandboxID  string
	SnapshotID string
}

// Rollback puts an existing running or paused sandbox back to a snapshot,
// keeping its ID, labels, resources and host mounts: the container is
// stopped, its disk replaced by a FICLONE of the snapshot disk, and it is
// booted again; it is Running afterwards (a disk-only snapshot holds no
// processes, so a paused sandbox comes back running). The sandbox is
// Snapshotting meanwhile.
//
// A failure leaves the sandbox as it was (old disk, agent answering,
// paused again if it was) or, if even that fails, Failed with everything
// it held released. The snapshot must come from the same template and
// runtime.
func (s *Service) Rollback(ctx context.Context, req RollbackRequest) (*Result, error) {
	if req.SnapshotID == "" {
		return nil, errdefs.FieldErrorf("snapshot_id", "required")
	}
	if len(req.RequestID) > 128 {
		return nil, errdefs.FieldErrorf("request_id", "longer than 128 bytes")
	}
	if _, err := s.lookup(req.SandboxID); err != nil {
		return nil, err
	}
	sn, release, err := s.useSnapshot(req.SnapshotID)
	if err != nil {
		return nil, err
	}
	defer release()
	e, err := s.lockFor(ctx, req.SandboxID, lifecycle.Snapshotting, "roll back")
	if err != nil {
		return nil, err
	}
	defer e.release()
	cur := e.rec.Load()
	if err := refuseDiskPaused(cur, "roll back"); err != nil {
		return nil, err
	}
	if sn.TemplateID != cur.TemplateID || sn.Runtime != cur.Runtime {
		return nil, fmt.Errorf("snapshot %s is of template %s on %s, sandbox %s is of template %s on %s: %w",
			sn.ID, sn.TemplateID, sn.Runtime, cur.ID, cur.TemplateID, cur.Runtime, errdefs.ErrFailedPrecondition)
	}
	if cur.Disk == nil || (cur.Mount == nil && !s.node.BootsDisk(cur.Runtime)) || cur.Container == nil {
		return nil, fmt.Errorf("sandbox %s holds no running container to roll back: %w", cur.ID, errdefs.ErrFailedPrecondition)
	}
	tmpl, err := s.store.GetTemplate(cur.TemplateID)
	if err != nil {
		return nil, fmt.Errorf("template of sandbox %s: %w", cur.ID, err)
	}

	log := s.log.With("sandbox_id", cur.ID, "snapshot_id", sn.ID, "request_id", req.RequestID)
	t := newTask(s.store, e, cur, tmpl)
	t.Rollback = &actions.RollbackRun{Snap: sn, Prev: cur.State}
	if err := t.Update(func(r *sandbox.Record) { r.State, r.PrevState = lifecycle.Snapshotting, cur.State }); err != nil {
		return nil, err
	}
	fctx, cancel := detached(ctx)
	defer cancel()
	res, err := s.engine.Run(fctx, FlowRollback, t)
	if err != nil {
		s.settleFailed(context.WithoutCancel(ctx), t, cur.State, err, log)
		return &Result{Sandbox: t.Record(), Timings: res.Timings}, err
	}
	// The staged file now holds the old disk.
	if err := os.Remove(actions.StagedDisk(cur.Disk.Path)); err != nil && !errors.Is(err, os.ErrNotExist) {
		log.Warn("remove the replaced disk; reconcile removes it on restart", "err", err)
	}
	if err := t.Update(func(r *sandbox.Record) {
		r.State, r.PrevState, r.SourceSnapshotID, r.Error = lifecycle.Running, "", sn.ID, ""
	}); err != nil {
		return nil, err
	}
	log.Info("sandbox rolled back", "duration", res.Duration)
	return &Result{Sandbox: t.Record(), Timings: res.Timings}, nil
}
