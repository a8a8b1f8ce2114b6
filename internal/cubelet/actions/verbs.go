package actions

import (
	"context"

	"github.com/cubesandbox/cube/internal/workflow"
)

// Flow names. Each is a verb of the engine; the config says which actions
// run in each.
const (
	FlowInit       = "init"
	FlowCreate     = "create"
	FlowDestroy    = "destroy"
	FlowCleanup    = "cleanup"
	FlowPause      = "pause"
	FlowResume     = "resume"
	FlowPauseDisk  = "pause_disk"
	FlowResumeDisk = "resume_disk"
	FlowSnapshot   = "snapshot"
	FlowClone      = "clone"
	FlowRollback   = "rollback"
)

// The capabilities an action may implement. An action implements only
// what it needs; the flow's verb decides which method runs, and an action
// named in a flow it cannot serve stops the daemon at start-up.
type (
	// Initializer runs once in the init flow, before the API serves.
	Initializer interface {
		Init(ctx context.Context) error
	}
	// Creator acquires a resource for a new sandbox. It must record the
	// resource in the task (Task.Update) BEFORE creating it.
	Creator interface {
		Create(ctx context.Context, t *Task) error
	}
	// Destroyer releases what Create acquired. It is the undo of a failed
	// create and the body of destroy and cleanup, so it must be idempotent
	// and harmless when Create never ran or only half ran.
	Destroyer interface {
		Destroy(ctx context.Context, t *Task) error
	}
	// Pauser freezes its part of a running sandbox, memory resident.
	Pauser interface {
		Pause(ctx context.Context, t *Task) error
	}
	// Resumer makes its part of a paused sandbox run again.
	Resumer interface {
		Resume(ctx context.Context, t *Task) error
	}
	// DiskPauser does its part of writing a running sandbox's memory to
	// disk and freeing it.
	DiskPauser interface {
		PauseToDisk(ctx context.Context, t *Task) error
		// UndoPauseToDisk brings the sandbox back running, as it was; it
		// must be idempotent and harmless when PauseToDisk never ran.
		UndoPauseToDisk(ctx context.Context, t *Task) error
	}
	// DiskResumer does its part of restoring a disk-paused sandbox.
	DiskResumer interface {
		ResumeFromDisk(ctx context.Context, t *Task) error
		// UndoResumeFromDisk leaves the sandbox disk-paused again, its
		// image untouched.
		UndoResumeFromDisk(ctx context.Context, t *Task) error
	}
	// Snapshotter does its part of taking a snapshot of a live sandbox:
	// freeze, flush, copy, thaw. The sandbox record is not changed by a
	// snapshot; what it produces goes into Task.Snapshot.
	Snapshotter interface {
		Snapshot(ctx context.Context, t *Task) error
		// UndoSnapshot reverts Snapshot. Like every undo it must be
		// idempotent and harmless when Snapshot never ran.
		UndoSnapshot(ctx context.Context, t *Task) error
	}
	// Cloner is a Creator that makes its resource from a snapshot
	// (Task.Clone) instead of the template. Clone flows call it instead of
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

// Every action's capabilities, checked at compile time.
var (
	_ Initializer = (*poolAction)(nil)
	_ Initializer = (*runtimesAction)(nil)
	_ Creator     = (*diskAction)(nil)
	_ Destroyer   = (*diskAction)(nil)
	_ Snapshotter = (*diskAction)(nil)
	_ Cloner      = (*diskAction)(nil)
	_ Rollbacker  = (*diskAction)(nil)
	_ Creator     = (*rootfsAction)(nil)
	_ Destroyer   = (*rootfsAction)(nil)
	_ Snapshotter = (*rootfsAction)(nil)
	_ Creator     = (*containerAction)(nil)
	_ Destroyer   = (*containerAction)(nil)
	_ Pauser      = (*containerAction)(nil)
	_ Resumer     = (*containerAction)(nil)
	_ Snapshotter = (*containerAction)(nil)
	_ Rollbacker  = (*containerAction)(nil)
	_ Creator     = (*agentAction)(nil)
	_ Destroyer   = (*agentAction)(nil)
	_ Resumer     = (*agentAction)(nil)
	_ Cloner      = (*agentAction)(nil)
	_ Rollbacker  = (*agentAction)(nil)
	_ Creator     = (*netAction)(nil)
	_ Destroyer   = (*netAction)(nil)
	_ Resumer     = (*netAction)(nil)
	_ Snapshotter = (*memoryAction)(nil)
	_ Snapshotter = (*thawAction)(nil)
	_ Snapshotter = (*quiesceAction)(nil)
	_ DiskPauser  = (*checkpointAction)(nil)
	_ DiskPauser  = (*evictAction)(nil)
	_ DiskResumer = (*restoreAction)(nil)
)

// step is how the engine calls (or undoes) a verb on one action.
type step = func(ctx context.Context, a workflow.Action, t *Task) error

// via calls capability I's method m on the action: Call: via(Creator.Create).
func via[I any](m func(I, context.Context, *Task) error) step {
	return func(ctx context.Context, a workflow.Action, t *Task) error { return m(a.(I), ctx, t) }
}

// either calls m on actions that have capability I and otherwise falls
// back to f (nil: nothing to do).
func either[I any](m func(I, context.Context, *Task) error, f step) step {
	return func(ctx context.Context, a workflow.Action, t *Task) error {
		if i, ok := a.(I); ok {
			return m(i, ctx, t)
		}
		if f == nil {
			return nil
		}
		return f(ctx, a, t)
	}
}

// Verbs is the verb table: for each flow, the capability its actions
// must have, how the engine calls it, and how it undoes it.
func Verbs() []workflow.Verb[*Task] {
	create, destroy := via(Creator.Create), via(Destroyer.Destroy)
	// Whatever a create or clone acquires, its undo must be able to
	// release.
	createsAndDestroys := func(a workflow.Action) bool {
		return workflow.Implements[Creator](a) && workflow.Implements[Destroyer](a)
	}
	return []workflow.Verb[*Task]{
		{
			Name: FlowInit, Mode: workflow.Init, Supports: workflow.Implements[Initializer],
			Call: func(ctx context.Context, a workflow.Action, _ *Task) error { return a.(Initializer).Init(ctx) },
		},
		{Name: FlowCreate, Mode: workflow.Forward, Supports: createsAndDestroys, Call: create, Undo: destroy},
		{Name: FlowDestroy, Mode: workflow.Teardown, Supports: workflow.Implements[Destroyer], Call: destroy},
		{Name: FlowCleanup, Mode: workflow.Teardown, Supports: workflow.Implements[Destroyer], Call: destroy},
		// A pause that fails part-way thaws what it froze: the sandbox
		// stays Running, as it was before the flow.
		{Name: FlowPause, Mode: workflow.Forward, Supports: workflow.Implements[Pauser],
			Call: via(Pauser.Pause), Undo: either(Resumer.Resume, nil)},
		// A resume whose agent never answers freezes the sandbox again: it
		// stays Paused, as it was before the flow.
		{Name: FlowResume, Mode: workflow.Forward, Supports: workflow.Implements[Resumer],
			Call: via(Resumer.Resume), Undo: either(Pauser.Pause, nil)},
		{Name: FlowPauseDisk, Mode: workflow.Forward, Supports: workflow.Implements[DiskPauser],
			Call: via(DiskPauser.PauseToDisk), Undo: via(DiskPauser.UndoPauseToDisk)},
		// "net" re-applies the policy (Resumer) before the restore; a
		// policy re-applied to a sandbox that stays paused is harmless.
		{Name: FlowResumeDisk, Mode: workflow.Forward,
			Supports: func(a workflow.Action) bool {
				return workflow.Implements[DiskResumer](a) || workflow.Implements[Resumer](a)
			},
			Call: either(DiskResumer.ResumeFromDisk, via(Resumer.Resume)),
			Undo: either(DiskResumer.UndoResumeFromDisk, nil)},
		{Name: FlowSnapshot, Mode: workflow.Forward, Supports: workflow.Implements[Snapshotter],
			Call: via(Snapshotter.Snapshot), Undo: via(Snapshotter.UndoSnapshot)},
		{Name: FlowClone, Mode: workflow.Forward, Supports: createsAndDestroys,
			Call: either(Cloner.Clone, create), Undo: destroy},
		{Name: FlowRollback, Mode: workflow.Forward, Supports: workflow.Implements[Rollbacker],
			Call: via(Rollbacker.Rollback), Undo: via(Rollbacker.UndoRollback)},
	}
}
