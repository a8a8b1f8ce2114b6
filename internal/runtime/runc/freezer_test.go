package runc

import (
	"context"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/runtime"
)

// TestFreezerCacheFollowsRestart: the freezer paths cached by a pause are
// not used for a container started again under the same ID in another
// cgroup: the new one is frozen (runc, which reads the freezer, says
// paused) and thawed. The control is the first container: its pause and
// resume go through the cache the second start must drop.
func TestFreezerCacheFollowsRestart(t *testing.T) {
	requireRoot(t)
	parent := cgroupParent(t)
	d := newTestDriver(t)
	t.Cleanup(func() { assertNoLeftovers(t, d, parent) })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const id = "freezer-cache"
	cycle := func(spec runtime.Spec) {
		t.Helper()
		if _, err := d.Start(ctx, spec); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = d.Stop(context.Background(), id) })
		for _, step := range []struct {
			do   func(context.Context, string) error
			want runtime.Status
		}{{d.Pause, runtime.StatusPaused}, {d.Resume, runtime.StatusRunning}, {d.Pause, runtime.StatusPaused}, {d.Resume, runtime.StatusRunning}} {
			if err := step.do(ctx, id); err != nil {
				t.Fatal(err)
			}
			st, err := d.State(ctx, id)
			if err != nil || st.Status != step.want {
				t.Fatalf("in %s: state %v %v, want %s", spec.CgroupPath, st.Status, err, step.want)
			}
		}
		if v, ok := d.freezers.Load(id); !ok || len(v.(map[string]string)) == 0 {
			t.Fatalf("no cached freezer paths after a pause of %s", spec.CgroupPath)
		}
		if err := d.Stop(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	first := sleepSpec(t, parent, id)
	cycle(first)
	second := sleepSpec(t, parent, id)
	second.CgroupPath = parent + "/" + id + "-again"
	cycle(second)
	t.Logf("paused and resumed %s, then %s under the same ID", first.CgroupPath, second.CgroupPath)
}
