package cubelet

import (
	"context"
	"fmt"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// launch starts the sandbox's container: restored from the memory image
// of the snapshot the task works from when its disk holds exactly that
// snapshot and the runtime can restore (clone, rollback), cold-booted
// otherwise (create, disk-only snapshots, runc, and an undone rollback
// whose disk is the old one again).
func launch(ctx context.Context, d runtime.Driver, t *Task, spec runtime.Spec) (runtime.State, error) {
	dir := memoryImage(d, t)
	if dir == "" {
		return d.Start(ctx, spec)
	}
	st, err := d.Restore(ctx, spec, dir)
	if err != nil {
		return st, err
	}
	// The image was taken with the agent quiesced (quiesce.go): wake it;
	// the agent action then waits for its /health. The caller's undo
	// stops the container if this fails.
	if w, ok := d.(agentWaker); ok {
		if err := w.WakeAgent(ctx, spec.ID); err != nil {
			return st, fmt.Errorf("wake restored agent: %w", err)
		}
	}
	return st, nil
}

// memoryImage is the memory image launch restores from, "" for a cold
// boot. The record's SourceSnapshotID names the snapshot the disk was
// cloned from at every instant (clone sets it at create, rollback when it
// swaps the disks and back), which is what makes disk and memory agree.
func memoryImage(d runtime.Driver, t *Task) string {
	if t.snap == nil || t.snap.snap == nil || !d.Capabilities().Restore {
		return ""
	}
	sn := t.snap.snap
	if !sn.HasMemory || sn.MemoryDir == "" || t.Record().SourceSnapshotID != sn.ID {
		return ""
	}
	return sn.MemoryDir
}

// inPlaceRestorer is a driver that can restart a checkpointed sandbox from
// its memory image under the same ID, bundle and namespaces (gvisor).
type inPlaceRestorer interface {
	RestoreInPlace(ctx context.Context, id, dir string) (runtime.State, error)
}

// restoreInPlace brings back the sandbox the memory action's checkpoint
// stopped, once the disk copy is done (or the snapshot is undone): from
// the image just written, then paused again if it was paused, with its
// agent answering when running. Nothing to do when no checkpoint stopped it.
func restoreInPlace(ctx context.Context, n *node, t *Task) error {
	o, err := op(t)
	if err != nil || !o.checkpointed {
		return err
	}
	rec := t.Record()
	d, err := n.driver(rec.Runtime)
	if err != nil {
		return err
	}
	r, ok := d.(inPlaceRestorer)
	if !ok {
		return fmt.Errorf("runtime %s checkpointed but cannot restore in place: %w", rec.Runtime, errdefs.ErrInternal)
	}
	st, err := r.RestoreInPlace(ctx, rec.Container.ID, o.snap.MemoryDir)
	if err != nil {
		return err
	}
	o.checkpointed = false
	// The restored container runs: nothing is frozen any more.
	o.froze = false
	if err := t.Update(func(r *sandbox.Record) { r.Container.PID = st.PID }); err != nil {
		return err
	}
	// The image holds a quiesced agent: wake it and wait for its /health
	// (also when the sandbox goes back to paused: it must answer once
	// resumed), then freeze it again if it was paused.
	if err := n.wakeAgent(ctx, t.Record()); err != nil {
		return err
	}
	o.quiesced = false
	if o.prev == lifecycle.Paused {
		return d.Pause(ctx, rec.Container.ID)
	}
	return nil
}
