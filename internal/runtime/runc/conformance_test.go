package runc

import (
	"context"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/runtimetest"
)

func TestConformance(t *testing.T) {
	requireRoot(t)
	var parent string
	runtimetest.Run(t,
		func(t *testing.T) runtime.Driver {
			parent = cgroupParent(t)
			d := newTestDriver(t)
			t.Cleanup(func() { assertNoLeftovers(t, d, parent) })
			return d
		},
		func(t *testing.T, id string) runtime.Spec { return sleepSpec(t, parent, id) },
	)
}

// assertNoLeftovers runs after every sandbox of a subtest was stopped: the
// runc root must be empty and no cgroup may remain below parent.
func assertNoLeftovers(t *testing.T, d *Driver, parent string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if all, err := d.List(ctx); err != nil || len(all) != 0 {
		t.Errorf("after cleanup, List = %+v, %v; want empty", all, err)
	}
	assertNoChildCgroups(t, parent)
}
