package cubelet

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/storage"
	"github.com/cubesandbox/cube/internal/workflow"
)

// Flows of the snapshot verbs.
const (
	FlowSnapshot = "snapshot"
	FlowClone    = "clone"
	FlowRollback = "rollback"
)

// The capabilities of the snapshot verbs.
type (
	// Snapshotter does its part of taking a snapshot of a live sandbox:
	// freeze, flush, copy, thaw. The sandbox record is not changed by a
	// snapshot; what it produces goes into Task.snap.
	Snapshotter interface {
		Snapshot(ctx context.Context, t *Task) error
		// UndoSnapshot reverts Snapshot. Like every undo it must be
		// idempotent and harmless when Snapshot never ran.
		UndoSnapshot(ctx context.Context, t *Task) error
	}
	// Cloner is a Creator that makes its resource from a snapshot
	// (Task.snap) instead of the template. Clone flows call it instead of
	// Create where an action has it; Destroy undoes either.
	Cloner interface {
		Clone(ctx context.Context, t *Task) error
	}
	// Rollbacker does its part of putting a sandbox back to a snapshot
	// while keeping its ID.
	Rollbacker interface {
		Rollback(ctx context.Context, t *Task) error
		// UndoRollback puts back what Rollback changed, so a failed
		// rollback leaves the sandbox as it was.
		UndoRollback(ctx context.Context, t *Task) error
	}
)

// snapOp is the typed state of one snapshot, clone or rollback run.
type snapOp struct {
	// snap is the snapshot being written (snapshot) or read (clone,
	// rollback).
	snap *sandbox.Snapshot
	// prev is the sandbox's state before the verb.
	prev lifecycle.State
	// froze: the snapshot flow paused a running container.
	froze bool
	// checkpointed: the memory action's checkpoint stopped the container;
	// the thaw action (or the memory action's undo) restores it in place.
	checkpointed bool
	// quiesced: the quiesce action quieted the agent and nothing has woken
	// it yet; thawedForQuiesce: it resumed a paused sandbox to do so.
	quiesced, thawedForQuiesce bool
	// stopped, swapped: how far a rollback got.
	stopped, swapped bool
	// prevSource is the sandbox's SourceSnapshotID before a rollback.
	prevSource string
}

func snapshotVerbs() []workflow.Verb[*Task] {
	return []workflow.Verb[*Task]{
		{
			Name:     FlowSnapshot,
			Mode:     workflow.Forward,
			Supports: workflow.Implements[Snapshotter],
			Call: func(ctx context.Context, a workflow.Action, t *Task) error {
				return a.(Snapshotter).Snapshot(ctx, t)
			},
			Undo: func(ctx context.Context, a workflow.Action, t *Task) error {
				return a.(Snapshotter).UndoSnapshot(ctx, t)
			},
		},
		{
			Name: FlowClone,
			Mode: workflow.Forward,
			Supports: func(a workflow.Action) bool {
				return workflow.Implements[Creator](a) && workflow.Implements[Destroyer](a)
			},
			Call: func(ctx context.Context, a workflow.Action, t *Task) error {
				if c, ok := a.(Cloner); ok {
					return c.Clone(ctx, t)
				}
				return a.(Creator).Create(ctx, t)
			},
			Undo: func(ctx context.Context, a workflow.Action, t *Task) error {
				return a.(Destroyer).Destroy(ctx, t)
			},
		},
		{
			Name:     FlowRollback,
			Mode:     workflow.Forward,
			Supports: workflow.Implements[Rollbacker],
			Call: func(ctx context.Context, a workflow.Action, t *Task) error {
				return a.(Rollbacker).Rollback(ctx, t)
			},
			Undo: func(ctx context.Context, a workflow.Action, t *Task) error {
				return a.(Rollbacker).UndoRollback(ctx, t)
			},
		},
	}
}

// registerSnapshotActions adds the actions only the snapshot verbs use.
func registerSnapshotActions(n *node, reg *workflow.Registry) {
	reg.MustRegister(&memoryAction{n: n}, &thawAction{n: n}, &quiesceAction{n: n})
}

var (
	_ Snapshotter = (*containerAction)(nil)
	_ Snapshotter = (*rootfsAction)(nil)
	_ Snapshotter = (*diskAction)(nil)
	_ Snapshotter = (*memoryAction)(nil)
	_ Snapshotter = (*thawAction)(nil)
	_ Snapshotter = (*quiesceAction)(nil)
	_ Cloner      = (*agentAction)(nil)
	_ Cloner      = (*diskAction)(nil)
	_ Rollbacker  = (*diskAction)(nil)
	_ Rollbacker  = (*containerAction)(nil)
	_ Rollbacker  = (*agentAction)(nil)
)

// op returns the task's snapshot state; a snapshot verb run without one is
// a programming error, reported instead of a nil dereference.
func op(t *Task) (*snapOp, error) {
	if t.snap == nil || t.snap.snap == nil {
		return nil, fmt.Errorf("snapshot verb without a snapshot: %w", errdefs.ErrInternal)
	}
	return t.snap, nil
}

// --- snapshot ---

// Snapshot freezes a running container so nothing writes to its disk
// while it is copied. A paused one is frozen already.
func (a *containerAction) Snapshot(ctx context.Context, t *Task) error {
	o, err := op(t)
	if err != nil {
		return err
	}
	rec := t.Record()
	if rec.Container == nil || o.prev != lifecycle.Running {
		return nil
	}
	d, err := a.n.driver(rec.Runtime)
	if err != nil {
		return err
	}
	// Set first: a pause that fails half-way must still be thawed.
	o.froze = true
	return settle(ctx, d, rec.Container.ID, runtime.StatusPaused, d.Pause(ctx, rec.Container.ID))
}

func (a *containerAction) UndoSnapshot(ctx context.Context, t *Task) error {
	return thaw(ctx, a.n, t)
}

// thaw resumes a container the snapshot flow froze.
func thaw(ctx context.Context, n *node, t *Task) error {
	o, err := op(t)
	if err != nil || !o.froze {
		return err
	}
	rec := t.Record()
	d, err := n.driver(rec.Runtime)
	if err != nil {
		return err
	}
	if err := settle(ctx, d, rec.Container.ID, runtime.StatusRunning, d.Resume(ctx, rec.Container.ID)); err != nil {
		return err
	}
	o.froze = false
	return nil
}

// Snapshot flushes the sandbox's filesystem, so the loop image under it
// holds every write made before the freeze.
func (a *rootfsAction) Snapshot(_ context.Context, t *Task) error {
	rec := t.Record()
	if rec.Mount == nil && a.n.bootsDisk(rec.Runtime) {
		// A VM's writes are in its memory image or already in the disk
		// file: QEMU drains and flushes its block devices when a
		// migration completes.
		return nil
	}
	if rec.Mount == nil {
		return fmt.Errorf("snapshot: sandbox has no root filesystem: %w", errdefs.ErrFailedPrecondition)
	}
	return storage.Syncfs(rec.Mount.Target)
}

// UndoSnapshot has nothing to undo: a flush changes nothing.
func (a *rootfsAction) UndoSnapshot(context.Context, *Task) error { return nil }

// Snapshot clones the (frozen, flushed) sandbox disk into the snapshot.
func (a *diskAction) Snapshot(ctx context.Context, t *Task) error {
	o, err := op(t)
	if err != nil {
		return err
	}
	rec := t.Record()
	if rec.Disk == nil {
		return fmt.Errorf("snapshot: sandbox has no disk: %w", errdefs.ErrFailedPrecondition)
	}
	return a.n.pool.Clone(ctx, rec.Disk.Path, o.snap.DiskPath)
}

func (a *diskAction) UndoSnapshot(_ context.Context, t *Task) error {
	o, err := op(t)
	if err != nil {
		return err
	}
	if err := os.Remove(o.snap.DiskPath); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// memoryAction writes the runtime's memory image into the snapshot when
// the runtime can checkpoint; otherwise the snapshot is disk-only
// (HasMemory false), which is what runc gives.
type memoryAction struct{ n *node }

func (*memoryAction) Name() string { return "memory" }

func (a *memoryAction) Snapshot(ctx context.Context, t *Task) error {
	o, err := op(t)
	if err != nil {
		return err
	}
	rec := t.Record()
	d, err := a.n.driver(rec.Runtime)
	if err != nil {
		return err
	}
	if !d.Capabilities().Checkpoint || rec.Container == nil {
		o.snap.HasMemory = false
		return nil
	}
	dir := a.n.pool.SnapshotMemoryDir(o.snap.ID)
	o.snap.MemoryDir = dir
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	if _, inPlace := d.(inPlaceRestorer); !inPlace {
		// The runtime saves a frozen sandbox and leaves it frozen (a VM
		// stays stopped after its migration, its disk flushed): the
		// thaw action resumes it once the disk is copied.
		if err := d.Checkpoint(ctx, rec.Container.ID, dir, true); err != nil {
			return err
		}
		o.snap.HasMemory = true
		return nil
	}
	// Not leave-running: the container stays stopped until the disk is
	// copied, so disk and memory image agree (memory.go).
	if err := d.Checkpoint(ctx, rec.Container.ID, dir, false); err != nil {
		return err
	}
	o.checkpointed = true
	o.snap.HasMemory = true
	return nil
}

func (a *memoryAction) UndoSnapshot(ctx context.Context, t *Task) error {
	o, err := op(t)
	if err != nil {
		return err
	}
	if err := restoreInPlace(ctx, a.n, t); err != nil {
		return err
	}
	o.snap.HasMemory = false
	return os.RemoveAll(a.n.pool.SnapshotMemoryDir(o.snap.ID))
}

// thawAction resumes what the container action froze, once the copy is
// done. It is its own action because an action runs once per flow and the
// thaw must come after the copy.
type thawAction struct{ n *node }

func (*thawAction) Name() string { return "thaw" }

func (a *thawAction) Snapshot(ctx context.Context, t *Task) error {
	if err := restoreInPlace(ctx, a.n, t); err != nil {
		return err
	}
	return thaw(ctx, a.n, t)
}

// UndoSnapshot is nothing: the container action's undo thaws whatever is
// still frozen.
func (a *thawAction) UndoSnapshot(context.Context, *Task) error { return nil }

// --- clone ---

// Clone gives a new sandbox its own clone of the snapshot disk, grown to
// the requested size.
func (a *diskAction) Clone(ctx context.Context, t *Task) error {
	o, err := op(t)
	if err != nil {
		return err
	}
	rec := t.Record()
	path := a.n.pool.SandboxDiskPath(rec.ID)
	if err := t.Update(func(r *sandbox.Record) { r.Disk = &sandbox.Disk{Path: path} }); err != nil {
		return err
	}
	if err := a.n.pool.Clone(ctx, o.snap.DiskPath, path); err != nil {
		return fmt.Errorf("clone snapshot disk: %w", err)
	}
	if want := rec.Resources.DiskMiB << 20; want > 0 {
		return growExt4(ctx, path, want)
	}
	return nil
}

// --- rollback ---

// stagedDisk is where a rollback puts the snapshot's clone before the
// sandbox is stopped; after the swap it holds the old disk until the
// rollback is done.
func stagedDisk(diskPath string) string { return diskPath + ".staged" }

// Rollback stages a clone of the snapshot disk next to the sandbox's
// disk. Nothing of the sandbox is touched yet, so a failure here leaves
// it running as it was.
func (a *diskAction) Rollback(ctx context.Context, t *Task) error {
	o, err := op(t)
	if err != nil {
		return err
	}
	rec := t.Record()
	if rec.Disk == nil {
		return fmt.Errorf("rollback: sandbox has no disk: %w", errdefs.ErrFailedPrecondition)
	}
	staged := stagedDisk(rec.Disk.Path)
	if err := os.Remove(staged); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	if err := a.n.pool.Clone(ctx, o.snap.DiskPath, staged); err != nil {
		return fmt.Errorf("stage snapshot disk: %w", err)
	}
	if want := rec.Resources.DiskMiB << 20; want > 0 {
		return growExt4(ctx, staged, want)
	}
	return nil
}

// UndoRollback removes the staged disk (by then the snapshot's clone
// again, the container action's undo having swapped the disks back).
func (a *diskAction) UndoRollback(_ context.Context, t *Task) error {
	rec := t.Record()
	if rec.Disk == nil {
		return nil
	}
	if err := os.Remove(stagedDisk(rec.Disk.Path)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// Rollback re-roots the sandbox on the staged disk: stop the container,
// unmount, swap the disk files atomically, mount, start. It goes through
// the same Destroy and Create that destroy and create use, so the record
// names exactly what exists at every instant.
func (a *containerAction) Rollback(ctx context.Context, t *Task) error {
	o, err := op(t)
	if err != nil {
		return err
	}
	rec := t.Record()
	if rec.Disk == nil || (rec.Mount == nil && !a.n.bootsDisk(rec.Runtime)) {
		return fmt.Errorf("rollback: sandbox has no mounted disk: %w", errdefs.ErrFailedPrecondition)
	}
	root := &rootfsAction{n: a.n}
	o.stopped = true
	if err := a.Destroy(ctx, t); err != nil {
		return err
	}
	if err := root.Destroy(ctx, t); err != nil {
		return err
	}
	if err := storage.Exchange(rec.Disk.Path, stagedDisk(rec.Disk.Path)); err != nil {
		return err
	}
	o.swapped = true
	// The record says which snapshot the disk now holds, at every instant.
	o.prevSource = rec.SourceSnapshotID
	if err := t.Update(func(r *sandbox.Record) { r.SourceSnapshotID = o.snap.ID }); err != nil {
		return err
	}
	if err := root.Create(ctx, t); err != nil {
		return err
	}
	return a.Create(ctx, t)
}

// UndoRollback brings the sandbox back on its old disk, with its agent
// answering and, if it was paused, paused again. If this fails too the
// caller marks the sandbox Failed and releases it.
func (a *containerAction) UndoRollback(ctx context.Context, t *Task) error {
	o, err := op(t)
	if err != nil || !o.stopped {
		return err
	}
	root := &rootfsAction{n: a.n}
	if err := a.Destroy(ctx, t); err != nil {
		return err
	}
	if err := root.Destroy(ctx, t); err != nil {
		return err
	}
	rec := t.Record()
	if o.swapped {
		if err := storage.Exchange(rec.Disk.Path, stagedDisk(rec.Disk.Path)); err != nil {
			return err
		}
		o.swapped = false
		if err := t.Update(func(r *sandbox.Record) { r.SourceSnapshotID = o.prevSource }); err != nil {
			return err
		}
	}
	if err := root.Create(ctx, t); err != nil {
		return err
	}
	if err := a.Create(ctx, t); err != nil {
		return err
	}
	if err := (&agentAction{n: a.n}).wait(ctx, t); err != nil {
		return err
	}
	o.stopped = false
	if o.prev == lifecycle.Paused {
		return a.Pause(ctx, t)
	}
	return nil
}

// Rollback waits for the agent of the re-rooted sandbox.
// A VM also re-syncs its clock: its memory image stopped the guest's time
// when the snapshot was taken.
func (a *agentAction) Rollback(ctx context.Context, t *Task) error {
	if err := a.wait(ctx, t); err != nil {
		return err
	}
	if a.n.bootsDisk(t.Record().Runtime) {
		return a.n.reinitAgent(ctx, t)
	}
	return nil
}

// UndoRollback has nothing to undo; the container's undo waits for the
// old sandbox's agent itself.
func (a *agentAction) UndoRollback(context.Context, *Task) error { return nil }
