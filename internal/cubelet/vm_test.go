package cubelet_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/vmguest"
)

// vmEnv starts cubelet with the vm runtime (guest artifacts built once
// into the shared cache) and network-agent (VM slots: a TAP per slot).
// The accelerator is CUBE_VM_ACCEL, TCG by default: what hosts without
// KVM run, and the slow case the suite must fit.
func vmEnv(t *testing.T, extra string) (*cubelettest.Env, *cubelet.Service) {
	t.Helper()
	cubelettest.RequireRoot(t)
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("needs qemu-system-x86_64 (Debian package qemu-system-x86)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	dir := filepath.Join(vmguest.DefaultCacheDir, "guest-cubelet")
	if _, err := vmguest.Build(ctx, vmguest.BuildConfig{OutDir: dir}); err != nil {
		t.Fatalf("guest artifacts: %v", err)
	}
	accel := os.Getenv("CUBE_VM_ACCEL")
	if accel == "" {
		accel = "tcg"
	}
	env := cubelettest.New(t, fmt.Sprintf("[vm]\nguest_dir = %q\naccel = %q\n[sandbox]\nagent_ready_timeout = \"120s\"\n%s", dir, accel, extra))
	env.StartNetworkAgent(t, nettest.Options{PoolSize: 1})
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	return env, svc
}

// TestVMSandboxes boots one micro-VM and runs every verb on it: the E2B
// path through the slot's TAP, pause/resume, a memory snapshot it keeps
// running after, 3 clones restored from that snapshot at once (each with
// the original's memory and its own identity), rollback, and a destroy of
// everything that leaves no QEMU, socket, TAP, disk or state behind.
func TestVMSandboxes(t *testing.T) {
	env, svc := vmEnv(t, "")
	ctx := context.Background()
	defer func() {
		for _, sb := range mustList(t, svc) {
			if _, err := svc.Delete(ctx, sb.ID); err != nil {
				t.Error(err)
			}
		}
		for _, sn := range listSnaps(t, svc, "") {
			_ = svc.DeleteSnapshot(ctx, sn)
		}
		assertSnapshotFiles(t, env, svc)
		env.AssertNoLeaks(t)
	}()

	start := time.Now()
	a := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "vm-a", Runtime: "vm", Env: map[string]string{"WHO": "a"}})
	t.Logf("cold boot to agent ready: %v", time.Since(start))
	if a.Runtime != "vm" || a.Container == nil || a.Mount != nil {
		t.Fatalf("vm sandbox %+v (a VM's disk is booted, not mounted)", a)
	}
	// The envd path (slot host IP -> TAP -> guest) and the env cubelet
	// handed the agent over its channel.
	wantMemory(t, svc, a.ID, map[string]string{"WHO": "a", "CUBE_SANDBOX_ID": a.ID})
	orig := map[string]string{"SECRET": fmt.Sprint(time.Now().UnixNano())}
	setMemory(t, svc, a.ID, orig)

	t.Run("pause resume", func(t *testing.T) {
		if _, err := svc.Pause(ctx, a.ID); err != nil {
			t.Fatal(err)
		}
		mustState(t, svc, a.ID, lifecycle.Paused)
		if _, err := svc.Resume(ctx, a.ID); err != nil {
			t.Fatal(err)
		}
		mustState(t, svc, a.ID, lifecycle.Running)
		wantMemory(t, svc, a.ID, orig)
	})

	start = time.Now()
	sn := mustSnapshot(t, svc, cubelet.SnapshotRequest{SandboxID: a.ID, SnapshotID: "vm-snap"})
	t.Logf("memory snapshot: %v, %d bytes", time.Since(start), sn.SizeBytes)
	if !sn.HasMemory || sn.Runtime != "vm" {
		t.Fatalf("snapshot %+v: want a memory snapshot of vm", sn)
	}
	mustState(t, svc, a.ID, lifecycle.Running)
	wantMemory(t, svc, a.ID, orig)

	t.Run("clone 3", func(t *testing.T) {
		start := time.Now()
		res, err := svc.Clone(ctx, cubelet.CloneRequest{SnapshotID: sn.ID, Count: 3})
		if err != nil {
			t.Fatalf("clone: %v", err)
		}
		t.Logf("clone of 3: %v", time.Since(start))
		for _, c := range res.Sandboxes {
			mustState(t, svc, c.ID, lifecycle.Running)
			want := map[string]string{"SECRET": orig["SECRET"], "CUBE_SANDBOX_ID": c.ID}
			wantMemory(t, svc, c.ID, want)
		}
		for _, c := range res.Sandboxes {
			if _, err := svc.Delete(ctx, c.ID); err != nil {
				t.Fatal(err)
			}
		}
	})

	t.Run("rollback", func(t *testing.T) {
		setMemory(t, svc, a.ID, map[string]string{"SECRET": "changed"})
		if _, err := svc.Rollback(ctx, cubelet.RollbackRequest{SandboxID: a.ID, SnapshotID: sn.ID}); err != nil {
			t.Fatalf("rollback: %v", err)
		}
		mustState(t, svc, a.ID, lifecycle.Running)
		wantMemory(t, svc, a.ID, orig)
	})
}
