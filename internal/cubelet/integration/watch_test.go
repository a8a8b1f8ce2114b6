package integration

import (
	"context"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// waitFailed waits until the runtime watch has marked sandbox id failed
// and released what it held (container, mount, disk, network slot), and
// returns the record.
func waitFailed(t *testing.T, svc *cubelet.Service, id string, within time.Duration) *sandbox.Record {
	t.Helper()
	begin := time.Now()
	for {
		r, err := svc.Get(context.Background(), id)
		if err != nil {
			t.Fatalf("get %s: %v", id, err)
		}
		if r.State == lifecycle.Failed && r.Container == nil && r.Mount == nil && r.Disk == nil && r.Network == nil {
			t.Logf("%s failed after %s: %s", id, time.Since(begin).Round(time.Millisecond), r.Error)
			return r
		}
		if time.Since(begin) > within {
			t.Fatalf("%s still %s %s after its process died", id, r.State, within)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// stays checks that sandbox id stays in state want for d.
func stays(t *testing.T, svc *cubelet.Service, id string, want lifecycle.State, d time.Duration) {
	t.Helper()
	for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		if r, _ := svc.Get(context.Background(), id); r == nil || r.State != want {
			t.Fatalf("%s: %+v, want it to stay %s", id, r, want)
		}
	}
}

// TestRuntimeWatch: a runc sandbox whose init is killed or OOM-killed is
// failed within seconds with the reason, what it held is released, and a
// delete removes the rest; a paused sandbox (its init frozen, not dead) is
// left alone, and the same kill after resume is seen (the control).
func TestRuntimeWatch(t *testing.T) {
	cubelettest.RequireRoot(t)
	env := cubelettest.New(t, "")
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()
	parent := t

	t.Run("init killed", func(t *testing.T) {
		sb := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "watch-kill", Runtime: "runc"})
		cleanupDelete(t, svc, sb.ID)
		if err := unix.Kill(sb.Container.PID, unix.SIGKILL); err != nil {
			t.Fatal(err)
		}
		t.Logf("sent SIGKILL to the init (host PID %d)", sb.Container.PID)
		r := waitFailed(t, svc, sb.ID, 5*time.Second)
		if !strings.Contains(r.Error, "sandbox died") || strings.Contains(r.Error, "OOM") {
			t.Fatalf("reason %q", r.Error)
		}
		if _, err := svc.Delete(ctx, sb.ID); err != nil {
			t.Fatalf("delete the dead sandbox: %v", err)
		}
		env.AssertNoLeaks(t)
	})

	t.Run("oom", func(t *testing.T) {
		sb := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "watch-oom", Runtime: "runc",
			Resources: sandbox.Resources{MemoryMiB: 32}})
		cleanupDelete(t, svc, sb.ID)
		// The init is the OOM killer's first choice; a process in the
		// sandbox then allocates past the limit.
		if err := os.WriteFile("/proc/"+strconv.Itoa(sb.Container.PID)+"/oom_score_adj", []byte("1000"), 0); err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command("runc", "--root", env.Config.Runc.Root, "exec", sb.Container.ID,
			"dd", "if=/dev/zero", "of=/dev/null", "bs=128M", "count=1").CombinedOutput()
		t.Logf("dd of 128 MiB under a 32 MiB limit: %v %s", err, strings.TrimSpace(string(out)))
		r := waitFailed(t, svc, sb.ID, 5*time.Second)
		if !strings.Contains(r.Error, "OOM killed") {
			t.Fatalf("reason %q, want an OOM kill", r.Error)
		}
		if _, err := svc.Delete(ctx, sb.ID); err != nil {
			t.Fatalf("delete the dead sandbox: %v", err)
		}
		env.AssertNoLeaks(t)
	})

	t.Run("paused is not dead", func(t *testing.T) {
		sb := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "watch-pause", Runtime: "runc"})
		cleanupDelete(t, svc, sb.ID)
		if _, err := svc.Pause(ctx, sb.ID); err != nil {
			t.Fatal(err)
		}
		stays(t, svc, sb.ID, lifecycle.Paused, 1500*time.Millisecond)
		if _, err := svc.Resume(ctx, sb.ID); err != nil {
			t.Fatal(err)
		}
		stays(t, svc, sb.ID, lifecycle.Running, 500*time.Millisecond)
		// Control: the watch follows this sandbox; a real death is seen.
		if err := unix.Kill(sb.Container.PID, unix.SIGKILL); err != nil {
			t.Fatal(err)
		}
		waitFailed(t, svc, sb.ID, 5*time.Second)
	})

	t.Run("adopted after a restart", func(t *testing.T) {
		sb := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "watch-adopt", Runtime: "runc"})
		if err := svc.Close(); err != nil {
			t.Fatal(err)
		}
		svc = env.Start(parent) // logs outlive the subtest
		cleanupDelete(t, svc, sb.ID)
		mustState(t, svc, sb.ID, lifecycle.Running)
		if err := unix.Kill(sb.Container.PID, unix.SIGKILL); err != nil {
			t.Fatal(err)
		}
		waitFailed(t, svc, sb.ID, 5*time.Second)
	})
}

// TestRuntimeWatchGvisor: the verbs that stop or replace a gVisor
// sandbox's process on purpose (a memory snapshot checkpoints it, a
// rollback replaces it, a pause to disk stops it and resume restores it)
// are never taken for a death; killing the runsc sandbox process after
// all of them is (the control: the watch follows the current process).
func TestRuntimeWatchGvisor(t *testing.T) {
	cubelettest.RequireRoot(t)
	requireRunsc(t)
	ctx := context.Background()
	env := cubelettest.New(t, "")
	env.StartNetworkAgent(t, nettest.Options{PoolSize: 3})
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	sb := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "watch-gv", Runtime: "gvisor"})
	cleanupDelete(t, svc, sb.ID)
	t.Cleanup(func() {
		for _, sn := range listSnaps(t, svc, "") {
			_ = svc.DeleteSnapshot(ctx, sn)
		}
	})
	pid := func() int {
		r := mustState(t, svc, sb.ID, lifecycle.Running)
		return r.Container.PID
	}
	before := pid()
	mustSnapshot(t, svc, cubelet.SnapshotRequest{SandboxID: sb.ID, SnapshotID: "watch-gv-snap"})
	stays(t, svc, sb.ID, lifecycle.Running, time.Second)
	t.Logf("memory snapshot: PID %d -> %d, still running", before, pid())
	before = pid()
	if _, err := svc.Rollback(ctx, cubelet.RollbackRequest{SandboxID: sb.ID, SnapshotID: "watch-gv-snap"}); err != nil {
		t.Fatal(err)
	}
	stays(t, svc, sb.ID, lifecycle.Running, time.Second)
	t.Logf("rollback: PID %d -> %d, still running", before, pid())
	before = pid()
	if _, err := svc.PauseTo(ctx, sb.ID, sandbox.PauseDisk); err != nil {
		t.Fatal(err)
	}
	stays(t, svc, sb.ID, lifecycle.Paused, time.Second)
	if _, err := svc.Resume(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	stays(t, svc, sb.ID, lifecycle.Running, time.Second)
	t.Logf("pause to disk and resume: PID %d -> %d, still running", before, pid())
	if err := unix.Kill(pid(), unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitFailed(t, svc, sb.ID, 5*time.Second)
	if _, err := svc.Delete(ctx, sb.ID); err != nil {
		t.Fatalf("delete the dead sandbox: %v", err)
	}
	env.AssertNoLeaks(t)
}

// TestRuntimeWatchVM: a VM whose QEMU is killed is failed within seconds
// and released; a paused VM (vCPUs stopped, QEMU alive) is not.
func TestRuntimeWatchVM(t *testing.T) {
	env, svc := vmEnv(t, "")
	ctx := context.Background()
	sb := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "watch-vm", Runtime: "vm"})
	cleanupDelete(t, svc, sb.ID)
	if _, err := svc.Pause(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	stays(t, svc, sb.ID, lifecycle.Paused, time.Second)
	if _, err := svc.Resume(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	r := mustState(t, svc, sb.ID, lifecycle.Running)
	if err := unix.Kill(r.Container.PID, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	t.Logf("sent SIGKILL to QEMU (PID %d)", r.Container.PID)
	waitFailed(t, svc, sb.ID, 10*time.Second)
	if _, err := svc.Delete(ctx, sb.ID); err != nil {
		t.Fatalf("delete the dead sandbox: %v", err)
	}
	env.AssertNoLeaks(t)
}
