package runc

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/runtime"
)

// TestFreezerCacheFollowsRestart: freezer paths cached for a container
// that was stopped are not trusted for a container started again under
// the same ID in another cgroup. Start and Stop forget the cache, so the
// test puts the first container's cached paths back after the restart
// (as a cache that outlived it would hold them): the pause must still
// freeze the new container (runc, which reads the freezer, says paused)
// and the resume thaw it, through the fallback that looks a gone cached
// path up again. Without that fallback the pause fails on the removed
// cgroup's freezer.state. The control is the first container: its pause
// and resume go through a cache that is current.
func TestFreezerCacheFollowsRestart(t *testing.T) {
	requireRoot(t)
	parent := cgroupParent(t)
	d := newTestDriver(t)
	t.Cleanup(func() { assertNoLeftovers(t, d, parent) })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const id = "freezer-cache"
	cycle := func(spec runtime.Spec, stale map[string]string) map[string]string {
		t.Helper()
		if _, err := d.Start(ctx, spec); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = d.Stop(context.Background(), id) })
		if stale != nil {
			d.freezers.Store(id, stale)
			t.Logf("cached freezer paths of the stopped container put back: %v", stale)
		}
		for _, step := range []struct {
			do   func(context.Context, string) error
			want runtime.Status
		}{{d.Pause, runtime.StatusPaused}, {d.Resume, runtime.StatusRunning}, {d.Pause, runtime.StatusPaused}, {d.Resume, runtime.StatusRunning}} {
			if err := step.do(ctx, id); err != nil {
				t.Fatalf("in %s: %v", spec.CgroupPath, err)
			}
			st, err := d.State(ctx, id)
			if err != nil || st.Status != step.want {
				t.Fatalf("in %s: state %v %v, want %s", spec.CgroupPath, st.Status, err, step.want)
			}
		}
		v, ok := d.freezers.Load(id)
		if !ok || len(v.(map[string]string)) == 0 {
			t.Fatalf("no cached freezer paths after a pause of %s", spec.CgroupPath)
		}
		paths := v.(map[string]string)
		if stale != nil && paths["freezer"] != "" && paths["freezer"] == stale["freezer"] {
			t.Fatalf("cache still names the stopped container's freezer %s", stale["freezer"])
		}
		if err := d.Stop(ctx, id); err != nil {
			t.Fatal(err)
		}
		return paths
	}
	first := sleepSpec(t, parent, id)
	stale := cycle(first, nil)
	if _, ok := d.freezers.Load(id); ok {
		t.Fatal("Stop kept the cached freezer paths")
	}
	for k, p := range stale {
		if _, err := os.Stat(p); err == nil {
			t.Fatalf("cgroup %s (%q) of the stopped container still exists: the cached path would not be stale", p, k)
		}
	}
	second := sleepSpec(t, parent, id)
	second.CgroupPath = parent + "/" + id + "-again"
	cycle(second, stale)
	t.Logf("paused and resumed %s, then %s under the same ID with %s's freezer paths cached", first.CgroupPath, second.CgroupPath, first.CgroupPath)
}
