package cubelet

import (
	"context"

	"github.com/cubesandbox/cube/internal/workflow"
)

// Flow names. Each is a verb of the engine; the config says which actions
// run in each.
const (
	FlowInit    = "init"
	FlowCreate  = "create"
	FlowDestroy = "destroy"
	FlowCleanup = "cleanup"
	FlowPause   = "pause"
	FlowResume  = "resume"
)

// verbs maps each flow to the action capability it calls. Later verbs
// (snapshot, clone, rollback) are added here without touching the engine.
func verbs() []workflow.Verb[*Task] {
	destroy := func(ctx context.Context, a workflow.Action, t *Task) error {
		return a.(Destroyer).Destroy(ctx, t)
	}
	return []workflow.Verb[*Task]{
		{
			Name:     FlowInit,
			Mode:     workflow.Init,
			Supports: workflow.Implements[Initializer],
			Call: func(ctx context.Context, a workflow.Action, _ *Task) error {
				return a.(Initializer).Init(ctx)
			},
		},
		{
			Name: FlowCreate,
			Mode: workflow.Forward,
			// Whatever a create acquires, its undo must be able to release.
			Supports: func(a workflow.Action) bool {
				return workflow.Implements[Creator](a) && workflow.Implements[Destroyer](a)
			},
			Call: func(ctx context.Context, a workflow.Action, t *Task) error {
				return a.(Creator).Create(ctx, t)
			},
			Undo: destroy,
		},
		{Name: FlowDestroy, Mode: workflow.Teardown, Supports: workflow.Implements[Destroyer], Call: destroy},
		{Name: FlowCleanup, Mode: workflow.Teardown, Supports: workflow.Implements[Destroyer], Call: destroy},
		{
			Name:     FlowPause,
			Mode:     workflow.Forward,
			Supports: workflow.Implements[Pauser],
			Call: func(ctx context.Context, a workflow.Action, t *Task) error {
				return a.(Pauser).Pause(ctx, t)
			},
			// A pause that fails part-way thaws what it froze: the sandbox
			// stays Running, as it was before the flow.
			Undo: func(ctx context.Context, a workflow.Action, t *Task) error {
				if r, ok := a.(Resumer); ok {
					return r.Resume(ctx, t)
				}
				return nil
			},
		},
		{
			Name:     FlowResume,
			Mode:     workflow.Forward,
			Supports: workflow.Implements[Resumer],
			Call: func(ctx context.Context, a workflow.Action, t *Task) error {
				return a.(Resumer).Resume(ctx, t)
			},
			// A resume whose agent never answers freezes the sandbox again:
			// it stays Paused, as it was before the flow.
			Undo: func(ctx context.Context, a workflow.Action, t *Task) error {
				if p, ok := a.(Pauser); ok {
					return p.Pause(ctx, t)
				}
				return nil
			},
		},
	}
}
