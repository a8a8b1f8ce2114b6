package actions

import (
	"context"
	"errors"
	"os"

	"github.com/cubesandbox/cube/internal/cubelet/agentclient"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// The snapshot's memory actions, in the order [flows.snapshot] runs them
// around the container, rootfs and disk steps:
//
//	quiesce   quiet the agent (runtimes that need it)       holds Quiesced
//	container freeze a running sandbox (container.go)        holds Frozen
//	memory    write the memory image; gVisor's checkpoint
//	          stops the sandbox                              holds Checkpointed
//	rootfs, disk: flush and copy the disk (storage.go)
//	thaw      give back Checkpointed (restore in place, wake
//	          the agent), then Frozen (resume)
//
// A failure undoes the started actions in reverse; each undo gives back
// the holds its action took and nothing has given back yet.

// checkpointStops says whether d's memory checkpoint stops the sandbox
// (it is then restored in place by the thaw step), so the memory step
// leaves nothing running while the disk is copied.
func checkpointStops(d runtime.Driver) bool {
	_, inPlace := d.(runtime.InPlaceRestorer)
	return inPlace && d.Capabilities().Checkpoint
}

// memoryAction writes the runtime's memory image into the snapshot when
// the runtime can checkpoint; otherwise the snapshot is disk-only
// (HasMemory false), which is what runc gives.
type memoryAction struct{ n *Node }

func (*memoryAction) Name() string { return "memory" }

func (a *memoryAction) Snapshot(ctx context.Context, t *Task) error {
	run, err := snapshotRun(t)
	if err != nil {
		return err
	}
	rec := t.Record()
	d, err := a.n.Driver(rec.Runtime)
	if err != nil {
		return err
	}
	if !d.Capabilities().Checkpoint || rec.Container == nil {
		run.Snap.HasMemory = false
		return nil
	}
	dir := a.n.Pool.SnapshotMemoryDir(run.Snap.ID)
	if err := a.n.checkImageRoom(rec, dir); err != nil {
		return err
	}
	run.Snap.MemoryDir = dir
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	r, inPlace := d.(runtime.InPlaceRestorer)
	if !inPlace {
		// The runtime saves a frozen sandbox and leaves it frozen (a VM
		// stays stopped after its migration, its disk flushed): the
		// thaw step resumes it once the disk is copied.
		if err := d.Checkpoint(ctx, rec.Container.ID, dir, true); err != nil {
			return err
		}
		run.Snap.HasMemory = true
		return nil
	}
	// Not leave-running: the container stays stopped until the disk is
	// copied, so disk and memory image agree.
	if err := d.Checkpoint(ctx, rec.Container.ID, dir, false); err != nil {
		return err
	}
	run.Holds.Take(Checkpointed, func(ctx context.Context) error {
		return a.n.restoreInPlace(ctx, t, run, d, r)
	})
	run.Snap.HasMemory = true
	return nil
}

func (a *memoryAction) UndoSnapshot(ctx context.Context, t *Task) error {
	run, err := snapshotRun(t)
	if err != nil {
		return err
	}
	// The image goes even when the sandbox could not be brought back
	// from it: a partial image left in the snapshot's directory would
	// break the next attempt under the same snapshot ID.
	err = run.Holds.Release(ctx, Checkpointed)
	run.Snap.HasMemory = false
	return errors.Join(err, os.RemoveAll(a.n.Pool.SnapshotMemoryDir(run.Snap.ID)))
}

// restoreInPlace brings back the sandbox the memory action's checkpoint
// stopped, once the disk copy is done (or the snapshot is undone): from
// the image just written, then paused again if it was paused, with its
// agent answering when running.
func (n *Node) restoreInPlace(ctx context.Context, t *Task, run *SnapshotRun, d runtime.Driver, r runtime.InPlaceRestorer) error {
	rec := t.Record()
	st, err := r.RestoreInPlace(ctx, rec.Container.ID, run.Snap.MemoryDir)
	if err != nil {
		return err
	}
	// The restored container runs: nothing is checkpointed or frozen any
	// more.
	run.Holds.Drop(Checkpointed, Frozen)
	if err := t.Update(func(r *sandbox.Record) { r.Container.PID = st.PID }); err != nil {
		return err
	}
	// The image holds a quiesced agent: wake it and wait for its /health
	// (also when the sandbox goes back to paused: it must answer once
	// resumed), then freeze it again if it was paused.
	if err := n.wakeAgent(ctx, t.Record()); err != nil {
		return err
	}
	run.Holds.Drop(Quiesced)
	if run.Prev == lifecycle.Paused {
		return d.Pause(ctx, rec.Container.ID)
	}
	return nil
}

// thawAction gives back what the earlier steps hold on the sandbox once
// the copy is done: a checkpointed sandbox is restored in place, a frozen
// one resumed. It is its own action because an action runs once per flow
// and the thaw must come after the copy.
type thawAction struct{ n *Node }

func (*thawAction) Name() string { return "thaw" }

func (a *thawAction) Snapshot(ctx context.Context, t *Task) error {
	run, err := snapshotRun(t)
	if err != nil {
		return err
	}
	if err := run.Holds.Release(ctx, Checkpointed); err != nil {
		return err
	}
	return run.Holds.Release(ctx, Frozen)
}

// UndoSnapshot is nothing: the memory and container actions' undos give
// back whatever is still held.
func (a *thawAction) UndoSnapshot(context.Context, *Task) error { return nil }

// quiesceAction quiets the agent before the memory action checkpoints,
// while the sandbox still runs (a paused sandbox is thawed for it and
// frozen again): first in [flows.snapshot].
type quiesceAction struct{ n *Node }

func (*quiesceAction) Name() string { return "quiesce" }

func (a *quiesceAction) Snapshot(ctx context.Context, t *Task) error {
	run, err := snapshotRun(t)
	if err != nil {
		return err
	}
	rec := t.Record()
	if !a.n.needsQuiesce(rec) {
		return nil
	}
	d, _ := a.n.Driver(rec.Runtime)
	thawed := false
	if run.Prev == lifecycle.Paused {
		if err := Settle(ctx, d, rec.Container.ID, runtime.StatusRunning, d.Resume(ctx, rec.Container.ID)); err != nil {
			return err
		}
		thawed = true
	}
	refreeze := func() error {
		if !thawed {
			return nil
		}
		return Settle(ctx, d, rec.Container.ID, runtime.StatusPaused, d.Pause(ctx, rec.Container.ID))
	}
	// Taken first: a quiesce whose answer was lost after the agent acted
	// must still be woken by the undo. A 409 means it changed nothing.
	run.Holds.Take(Quiesced, func(ctx context.Context) error {
		return a.n.wakeQuiesced(ctx, t, &run.Holds)
	})
	if err := agentclient.Quiesce(ctx, d, rec); err != nil {
		if errdefs.IsFailedPrecondition(err) {
			run.Holds.Drop(Quiesced)
		}
		return errors.Join(err, refreeze())
	}
	return refreeze()
}

// UndoSnapshot wakes an agent still quiesced (no checkpoint stopped the
// sandbox, or its restore already woke it and dropped the hold).
func (a *quiesceAction) UndoSnapshot(ctx context.Context, t *Task) error {
	run, err := snapshotRun(t)
	if err != nil {
		return err
	}
	return run.Holds.Release(ctx, Quiesced)
}

// wakeQuiesced wakes the agent the quiesce action quieted, leaving the
// sandbox paused again if it was.
func (n *Node) wakeQuiesced(ctx context.Context, t *Task, holds *Ledger) error {
	rec := t.Record()
	d, err := n.Driver(rec.Runtime)
	if err != nil {
		return err
	}
	st, err := d.State(ctx, rec.Container.ID)
	if err != nil {
		return err
	}
	if st.Status == runtime.StatusPaused {
		if err := d.Resume(ctx, rec.Container.ID); err != nil {
			return err
		}
	}
	if err := n.wakeAgent(ctx, rec); err != nil {
		return err
	}
	holds.Drop(Quiesced)
	if st.Status == runtime.StatusPaused {
		return d.Pause(ctx, rec.Container.ID)
	}
	return nil
}

// WakeInterrupted wakes the agent of a sandbox whose snapshot a crash
// cut short after its quiesce: nothing else would, and a quiesced agent
// answers nothing. A paused sandbox is thawed for it and frozen again.
// Waking an agent that is not quiesced changes nothing; runtimes that
// need no quiesce are left alone.
func (n *Node) WakeInterrupted(ctx context.Context, rec *sandbox.Record) error {
	if rec.Container == nil || !n.needsQuiesce(rec) {
		return nil
	}
	d, err := n.Driver(rec.Runtime)
	if err != nil {
		return err
	}
	st, err := d.State(ctx, rec.Container.ID)
	if err != nil {
		return err
	}
	paused := st.Status == runtime.StatusPaused
	if paused {
		if err := Settle(ctx, d, rec.Container.ID, runtime.StatusRunning, d.Resume(ctx, rec.Container.ID)); err != nil {
			return err
		}
	}
	err = n.wakeAgent(ctx, rec)
	if paused {
		err = errors.Join(err, Settle(ctx, d, rec.Container.ID, runtime.StatusPaused, d.Pause(ctx, rec.Container.ID)))
	}
	return err
}
