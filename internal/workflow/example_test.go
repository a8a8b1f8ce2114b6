package workflow_test

import (
	"context"
	"fmt"

	"github.com/cubesandbox/cube/internal/workflow"
)

// Task is the per-run state the actions share (cubelet's holds the typed
// sandbox record).
type Task struct{ Disk string }

// Creator is the "create" capability.
type Creator interface {
	Create(ctx context.Context, t *Task) error
}

type diskClone struct{}

func (diskClone) Name() string { return "disk.clone" }
func (diskClone) Create(_ context.Context, t *Task) error {
	t.Disk = "/var/lib/cube/disks/sb-1.img"
	return nil
}

func Example() {
	reg := workflow.NewRegistry()
	reg.MustRegister(diskClone{})
	verbs := []workflow.Verb[*Task]{{
		Name:     "create",
		Mode:     workflow.Forward,
		Supports: workflow.Implements[Creator],
		Call: func(ctx context.Context, a workflow.Action, t *Task) error {
			return a.(Creator).Create(ctx, t)
		},
	}}
	cfg := workflow.Config{"create": {Limit: 10, Steps: [][]string{{"disk.clone"}}}}
	eng, err := workflow.New(reg, verbs, cfg)
	if err != nil {
		panic(err)
	}
	t := &Task{}
	res, err := eng.Run(context.Background(), "create", t)
	fmt.Println(err, t.Disk, len(res.Timings), res.Timings[0].Action)

	_, err = workflow.New(reg, verbs, workflow.Config{"create": {Steps: [][]string{{"disk.clon"}}}})
	fmt.Println(err)
	// Output:
	// <nil> /var/lib/cube/disks/sb-1.img 1 disk.clone
	// workflow: flow "create" step 1: unknown action "disk.clon": invalid argument
}
