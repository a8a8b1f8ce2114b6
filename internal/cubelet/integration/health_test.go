package integration

import (
	"context"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
)

// TestHealthWindow: with runc's root made read-only, the node first turns
// busy (one failed probe: still healthy, still placeable), then unhealthy
// once the probe has failed 3 times in a row, and healthy again at the
// first probe after the root is writable. Sandbox creates and deletes in
// between never fail a probe (the probes list no containers).
func TestHealthWindow(t *testing.T) {
	cubelettest.RequireRoot(t)
	env := cubelettest.New(t, "")
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()
	runcCond := func() (ok, busy bool, msg string) {
		_, conds := svc.Health(ctx)
		for _, c := range conds {
			if c.Type == "runtime/runc" {
				r := svc.NodeReport(ctx)
				return c.OK, r.Busy, c.Message
			}
		}
		t.Fatalf("no runtime/runc condition in %+v", conds)
		return
	}
	waitCond := func(what string, within time.Duration, want func(ok, busy bool) bool) time.Duration {
		t.Helper()
		begin := time.Now()
		for {
			ok, busy, msg := runcCond()
			if want(ok, busy) {
				t.Logf("%s after %s (ok=%v busy=%v %s)", what, time.Since(begin).Round(10*time.Millisecond), ok, busy, msg)
				return time.Since(begin)
			}
			if time.Since(begin) > within {
				t.Fatalf("not %s within %s: ok=%v busy=%v %s", what, within, ok, busy, msg)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}

	// Churn: creates and deletes while probes run; the node stays healthy
	// and not busy on account of its runtime.
	for i := range 6 {
		sb := mustCreate(t, svc, cubelet.CreateRequest{Runtime: "runc"})
		if _, err := svc.Delete(ctx, sb.ID); err != nil {
			t.Fatal(err)
		}
		if ok, _, msg := runcCond(); !ok || msg != "" {
			t.Fatalf("churn %d: runtime/runc ok=%v %q", i, ok, msg)
		}
	}

	root := env.Config.Runc.Root
	if err := unix.Mount(root, root, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	mounted := true
	unmount := func() {
		if mounted {
			if err := unix.Unmount(root, unix.MNT_DETACH); err != nil {
				t.Error(err)
			}
			mounted = false
		}
	}
	t.Cleanup(unmount)
	if err := unix.Mount("", root, "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY, ""); err != nil {
		t.Fatal(err)
	}
	waitCond("busy but healthy", 3*time.Second, func(ok, busy bool) bool { return ok && busy })
	d := waitCond("unhealthy", 6*time.Second, func(ok, _ bool) bool { return !ok })
	if d < time.Second {
		t.Fatalf("unhealthy %s after the first failed probe: want 3 probes a second apart", d)
	}
	unmount()
	waitCond("healthy and not busy again", 3*time.Second, func(ok, busy bool) bool { return ok && !busy })
}
