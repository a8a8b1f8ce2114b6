package gvisor

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/runtime"
)

// TestMeasure prints the medians docs/gvisor.md reports: the
// driver's verbs next to the bare runsc commands they wrap, in one run.
// It only runs with CUBE_GVISOR_MEASURE=<iterations>.
func TestMeasure(t *testing.T) {
	requireRunsc(t)
	n := 0
	if _, err := fmt.Sscan(os.Getenv("CUBE_GVISOR_MEASURE"), &n); err != nil || n <= 0 {
		t.Skip("set CUBE_GVISOR_MEASURE=<iterations> to measure")
	}
	d, parent := newTestDriver(t), cgroupParent(t)
	ctx := t.Context()
	times := map[string][]time.Duration{}
	timed := func(name string, fn func() error) {
		t.Helper()
		begin := time.Now()
		if err := fn(); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		times[name] = append(times[name], time.Since(begin))
	}
	raw := func(args ...string) error {
		argv := append([]string{"--root", d.root, "--platform=" + d.platform, "--network=none"}, args...)
		cmd := exec.CommandContext(ctx, d.bin, argv...)
		devnull, _ := os.OpenFile(os.DevNull, os.O_RDWR, 0)
		defer devnull.Close()
		cmd.Stdin, cmd.Stdout, cmd.Stderr = devnull, devnull, devnull
		return cmd.Run()
	}
	for i := range n {
		id := fmt.Sprintf("m%d", i)
		spec := shellSpec(t, parent, id, counterScript)
		stopAtEnd(t, d, id)
		timed("create (cold): driver Start", func() error { _, err := d.Start(ctx, spec); return err })
		readState(t, d, id)
		img := filepath.Join(t.TempDir(), "img")
		timed("snapshot: driver Checkpoint(leaveRunning)", func() error { return d.Checkpoint(ctx, id, img, true) })
		timed("pause (freeze): driver Pause", func() error { return d.Pause(ctx, id) })
		timed("resume (thaw): driver Resume", func() error { return d.Resume(ctx, id) })
		img2 := filepath.Join(t.TempDir(), "img")
		timed("pause-to-disk: driver Checkpoint+Stop", func() error {
			if err := d.Checkpoint(ctx, id, img2, false); err != nil {
				return err
			}
			return d.Stop(ctx, id)
		})
		timed("resume from disk: driver Restore", func() error { _, err := d.Restore(ctx, spec, img2); return err })
		c := spec
		c.ID, c.CgroupPath, c.BundleDir = id+"-c", parent+"/"+id+"-c", filepath.Join(t.TempDir(), "bundle")
		stopAtEnd(t, d, c.ID)
		timed("clone of 1: driver Restore", func() error { _, err := d.Restore(ctx, c, img); return err })
		timed("stop: driver Stop (running sandbox)", func() error { return d.Stop(ctx, c.ID) })
		if err := d.Stop(ctx, id); err != nil {
			t.Fatal(err)
		}

		// The same operations with bare runsc on the same bundle.
		rid := "raw" + id
		t.Cleanup(func() { _ = raw("delete", "-force", rid) })
		timed("create (cold): runsc run -detach", func() error { return raw("run", "-detach", "--bundle", spec.BundleDir, rid) })
		time.Sleep(200 * time.Millisecond)
		rimg := filepath.Join(t.TempDir(), "img")
		timed("pause (freeze): runsc pause", func() error { return raw("pause", rid) })
		timed("resume (thaw): runsc resume", func() error { return raw("resume", rid) })
		timed("pause-to-disk: runsc checkpoint", func() error { return raw("checkpoint", "--image-path", rimg, rid) })
		timed("stop: runsc delete -force (of the checkpointed sandbox)", func() error { return raw("delete", "-force", rid) })
		timed("resume from disk: runsc restore -detach", func() error {
			return raw("restore", "--image-path", rimg, "-detach", "--bundle", spec.BundleDir, rid)
		})
		if err := raw("delete", "-force", rid); err != nil {
			t.Fatal(err)
		}
	}
	// Clone of 10: ten restores at once from one image.
	src := shellSpec(t, parent, "m-src", counterScript)
	stopAtEnd(t, d, src.ID)
	if _, err := d.Start(ctx, src); err != nil {
		t.Fatal(err)
	}
	readState(t, d, src.ID)
	img := filepath.Join(t.TempDir(), "img")
	if err := d.Checkpoint(ctx, src.ID, img, false); err != nil {
		t.Fatal(err)
	}
	for r := range max(1, n/3) {
		specs := make([]runtime.Spec, 10)
		for i := range specs {
			s := src
			s.ID = fmt.Sprintf("m10-%d-%d", r, i)
			s.CgroupPath, s.BundleDir = parent+"/"+s.ID, filepath.Join(t.TempDir(), "bundle")
			specs[i] = s
			stopAtEnd(t, d, s.ID)
		}
		timed("clone of 10: 10 driver Restores at once", func() error {
			var wg sync.WaitGroup
			errs := make([]error, len(specs))
			for i := range specs {
				wg.Go(func() { _, errs[i] = d.Restore(context.WithoutCancel(ctx), specs[i], img) })
			}
			wg.Wait()
			for _, err := range errs {
				if err != nil {
					return err
				}
			}
			return nil
		})
		for _, s := range specs {
			if err := d.Stop(ctx, s.ID); err != nil {
				t.Fatal(err)
			}
		}
	}
	names := make([]string, 0, len(times))
	for k := range times {
		names = append(names, k)
	}
	slices.Sort(names)
	for _, k := range names {
		v := slices.Clone(times[k])
		slices.Sort(v)
		t.Logf("median %-45s %8.1f ms  (n=%d)", k, float64(v[len(v)/2].Microseconds())/1000, len(v))
	}
}
