package integration

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/store"
)

// TestPauseModesRunc: runc pauses in memory only; a pause to disk is
// refused before anything changes.
func TestPauseModesRunc(t *testing.T) {
	env := cubelettest.New(t, "")
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()
	sb := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "pm-runc", Runtime: "runc"})
	defer func() {
		if _, err := svc.Delete(ctx, sb.ID); err != nil {
			t.Error(err)
		}
		env.AssertNoLeaks(t)
	}()
	if _, err := svc.PauseTo(ctx, sb.ID, sandbox.PauseDisk); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("pause to disk on runc = %v, want FailedPrecondition", err)
	}
	if r := mustState(t, svc, sb.ID, lifecycle.Running); r.PauseMode != "" {
		t.Fatalf("pause mode %q after a refused pause", r.PauseMode)
	}
	if _, err := svc.PauseTo(ctx, sb.ID, "swap"); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("pause with mode swap = %v, want InvalidArgument", err)
	}
	if _, err := svc.Pause(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	if r := mustState(t, svc, sb.ID, lifecycle.Paused); r.PauseMode != sandbox.PauseMemory {
		t.Fatalf("pause mode %q, want memory", r.PauseMode)
	}
	if _, err := svc.Resume(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	if r := mustState(t, svc, sb.ID, lifecycle.Running); r.PauseMode != "" {
		t.Fatalf("pause mode %q after resume", r.PauseMode)
	}
}

// runscProcs lists the processes started with the env's runsc root
// (sandbox, gofer, ptrace stubs, runsc commands), as the leak checker does.
func runscProcs(t *testing.T, env *cubelettest.Env) []string {
	t.Helper()
	root := env.Config.Gvisor.Root
	var out []string
	procs, _ := os.ReadDir("/proc")
	for _, e := range procs {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		cmd, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimRight(string(cmd), "\x00"), "\x00")
		for i, a := range args {
			if a == "--root="+root || (a == "--root" && i+1 < len(args) && args[i+1] == root) {
				out = append(out, e.Name()+" "+strings.Join(args, " "))
				break
			}
		}
	}
	return out
}

// TestGvisorPauseToDisk drives pause-to-disk of a gVisor sandbox with real
// runsc: memory survives, the runtime holds nothing while paused, faults
// roll back, a restarted cubelet adopts and resumes it, destroy leaves
// nothing.
func TestGvisorPauseToDisk(t *testing.T) {
	cubelettest.RequireRoot(t)
	requireRunsc(t)
	ctx := context.Background()
	env := cubelettest.New(t, "")
	env.StartNetworkAgent(t, nettest.Options{PoolSize: 3})
	// Started by hand, not env.Start: the test restarts it.
	svc, err := cubelet.New(ctx, env.Config, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { svc.Close() }()
	env.ImportBusybox(t, svc, "busybox")

	a := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "pd-a", Runtime: "gvisor"})
	image := filepath.Join(env.Config.PoolDir(), "sandboxes", a.ID, "paused-memory")
	defer func() {
		for _, sb := range mustList(t, svc) {
			if _, err := svc.Delete(ctx, sb.ID); err != nil {
				t.Error(err)
			}
		}
		env.AssertNoLeaks(t)
	}()
	orig := "pd-value"
	setMemory(t, svc, a.ID, map[string]string{"SECRET": orig})
	counter(t, svc, a.ID, orig)
	shell(t, svc, a.ID, `echo on-disk > /root/f`)

	pauseToDisk := func(t *testing.T) {
		t.Helper()
		res, err := svc.PauseTo(ctx, a.ID, sandbox.PauseDisk)
		if err != nil {
			t.Fatalf("pause to disk: %v", err)
		}
		if res.Sandbox.PauseMode != sandbox.PauseDisk || res.Sandbox.State != lifecycle.Paused {
			t.Fatalf("after pause to disk: %s/%s", res.Sandbox.State, res.Sandbox.PauseMode)
		}
		if _, err := os.Stat(image); err != nil {
			t.Fatalf("memory image: %v", err)
		}
		// The only sandbox of this runsc root is on disk: no sentry,
		// gofer or stub may remain (its memory is freed).
		if p := runscProcs(t, env); len(p) > 0 {
			t.Fatalf("disk-paused, yet runsc processes remain: %v", p)
		}
	}
	resume := func(t *testing.T) {
		t.Helper()
		res, err := svc.Resume(ctx, a.ID)
		if err != nil {
			t.Fatalf("resume from disk: %v", err)
		}
		if res.Sandbox.PauseMode != "" || res.Sandbox.State != lifecycle.Running {
			t.Fatalf("after resume: %s/%q", res.Sandbox.State, res.Sandbox.PauseMode)
		}
		if _, err := os.Stat(image); !os.IsNotExist(err) {
			t.Fatalf("memory image still there after resume: %v", err)
		}
		wantMemory(t, svc, a.ID, map[string]string{"SECRET": orig})
		holds(t, svc, a.ID, orig)
		if got := shell(t, svc, a.ID, `cat /root/f`); got != "on-disk" {
			t.Fatalf("file after resume: %q", got)
		}
	}

	t.Run("state survives", func(t *testing.T) {
		pauseToDisk(t)
		_, err := svc.Snapshot(ctx, cubelet.SnapshotRequest{SandboxID: a.ID, SnapshotID: "pd-never"})
		if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "resume it first") {
			t.Fatalf("snapshot of a disk-paused sandbox = %v, want FailedPrecondition", err)
		}
		if _, err := svc.PauseTo(ctx, a.ID, sandbox.PauseDisk); err == nil {
			t.Fatal("second pause to disk succeeded")
		}
		resume(t)
	})

	t.Run("refused with a user listener", func(t *testing.T) {
		shell(t, svc, a.ID, `(nc -l -p 8080 </dev/null >/dev/null 2>&1 &) ; sleep 0.3`)
		_, err := svc.PauseTo(ctx, a.ID, sandbox.PauseDisk)
		if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), ":8080") {
			t.Fatalf("pause to disk with a listener = %v, want FailedPrecondition naming :8080", err)
		}
		mustState(t, svc, a.ID, lifecycle.Running)
		holds(t, svc, a.ID, orig)
		shell(t, svc, a.ID, `killall nc; sleep 0.2`)
	})

	t.Run("faults", func(t *testing.T) {
		for _, p := range points(svc, cubelet.FlowPauseDisk) {
			inject(t, p, "1*error")
			if _, err := svc.PauseTo(ctx, a.ID, sandbox.PauseDisk); !errors.Is(err, failpoint.ErrInjected) {
				t.Fatalf("%s: want injected error, got %v", p, err)
			}
			failpoint.Disable(p)
			if r := mustState(t, svc, a.ID, lifecycle.Running); r.PauseMode != "" {
				t.Fatalf("%s: pause mode %q", p, r.PauseMode)
			}
			if _, err := os.Stat(image); !os.IsNotExist(err) {
				t.Fatalf("%s: image left after a failed pause: %v", p, err)
			}
			holds(t, svc, a.ID, orig)
		}
		pauseToDisk(t)
		for _, p := range points(svc, cubelet.FlowResumeDisk) {
			inject(t, p, "1*error")
			if _, err := svc.Resume(ctx, a.ID); !errors.Is(err, failpoint.ErrInjected) {
				t.Fatalf("%s: want injected error, got %v", p, err)
			}
			failpoint.Disable(p)
			if r := mustState(t, svc, a.ID, lifecycle.Paused); r.PauseMode != sandbox.PauseDisk {
				t.Fatalf("%s: pause mode %q", p, r.PauseMode)
			}
			if p := runscProcs(t, env); len(p) > 0 {
				t.Fatalf("%s: failed resume left runsc processes: %v", p, p)
			}
		}
		resume(t)
	})

	t.Run("restart", func(t *testing.T) {
		pauseToDisk(t)
		svc.Close()
		if svc, err = cubelet.New(ctx, env.Config, nil); err != nil {
			t.Fatalf("restart: %v", err)
		}
		if r := mustState(t, svc, a.ID, lifecycle.Paused); r.PauseMode != sandbox.PauseDisk {
			t.Fatalf("adopted with pause mode %q", r.PauseMode)
		}
		resume(t)
	})

	t.Run("crash after the image was written", func(t *testing.T) {
		// cubelet dies after the checkpoint and eviction but before the
		// record says Paused: the record is Running with the disk intent.
		pauseToDisk(t)
		svc.Close()
		st, err := store.Open(env.Config.StorePath())
		if err != nil {
			t.Fatal(err)
		}
		r, err := st.GetSandbox(a.ID)
		if err == nil {
			r.State = lifecycle.Running
			err = st.PutSandbox(r)
		}
		st.Close()
		if err != nil {
			t.Fatal(err)
		}
		if svc, err = cubelet.New(ctx, env.Config, nil); err != nil {
			t.Fatalf("restart: %v", err)
		}
		if r := mustState(t, svc, a.ID, lifecycle.Paused); r.PauseMode != sandbox.PauseDisk {
			t.Fatalf("adopted with pause mode %q", r.PauseMode)
		}
		resume(t)
	})

	t.Run("destroy while on disk", func(t *testing.T) {
		pauseToDisk(t)
		if _, err := svc.Delete(ctx, a.ID); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(filepath.Dir(image)); !os.IsNotExist(err) {
			t.Fatalf("sandbox pool directory left: %v", err)
		}
		env.AssertNoLeaks(t)
	})
}
