package integration

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/testenv"
	"github.com/cubesandbox/cube/internal/vmguest"
)

// vmEnv starts cubelet with the vm runtime (guest artifacts built once
// into the shared cache) and network-agent (VM slots: a TAP per slot).
// The accelerator is CUBE_VM_ACCEL, TCG by default: what hosts without
// KVM run, and the slow case the suite must fit.
func vmEnv(t *testing.T, extra string) (*cubelettest.Env, *cubelet.Service) {
	t.Helper()
	return vmEnvWith(t, "", extra)
}

// vmEnvWith is vmEnv with vmTOML added to its [vm] section and extra
// to its [sandbox] section.
func vmEnvWith(t *testing.T, vmTOML, extra string) (*cubelettest.Env, *cubelet.Service) {
	t.Helper()
	cubelettest.RequireRoot(t)
	testenv.RequireBinary(t, "qemu-system-x86_64", "qemu-system-x86")
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
	env := cubelettest.New(t, fmt.Sprintf("[vm]\nguest_dir = %q\naccel = %q\n%s\n[sandbox]\nagent_ready_timeout = \"120s\"\n%s", dir, accel, vmTOML, extra))
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
	top := t
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
	// A guest process holding a value only in its memory, and a file.
	counter(t, svc, a.ID, "vm-memory")
	shell(t, svc, a.ID, `echo on-disk > /root/file; sync`)
	if got := shell(t, svc, a.ID, `hostname`); got != a.ID {
		t.Fatalf("hostname %q, want %s", got, a.ID)
	}
	// Once up, the guest cannot grow the host's console file.
	console := filepath.Join(a.Container.Bundle, "console.log")
	before, err := os.Stat(console)
	if err != nil {
		t.Fatal(err)
	}
	shell(t, svc, a.ID, `head -c 1000000 /dev/zero > /dev/ttyS0`)
	if after, err := os.Stat(console); err != nil || after.Size() != before.Size() {
		t.Fatalf("console file grew from %d to %v (%v) after the guest wrote 1 MB to ttyS0", before.Size(), after.Size(), err)
	}

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

	t.Run("pause to disk", func(t *testing.T) {
		start := time.Now()
		if _, err := svc.PauseTo(ctx, a.ID, sandbox.PauseDisk); err != nil {
			t.Fatal(err)
		}
		t.Logf("pause to disk: %v", time.Since(start))
		sb := mustState(t, svc, a.ID, lifecycle.Paused)
		if sb.PauseMode != sandbox.PauseDisk {
			t.Fatalf("pause mode %q", sb.PauseMode)
		}
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", sb.Container.PID)); err == nil {
			t.Fatalf("QEMU (pid %d) still runs while paused to disk", sb.Container.PID)
		}
		start = time.Now()
		if _, err := svc.Resume(ctx, a.ID); err != nil {
			t.Fatal(err)
		}
		t.Logf("resume from disk: %v", time.Since(start))
		mustState(t, svc, a.ID, lifecycle.Running)
		wantMemory(t, svc, a.ID, orig)
		holds(t, svc, a.ID, "vm-memory")
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
		macs := map[string]string{}
		for _, c := range res.Sandboxes {
			mustState(t, svc, c.ID, lifecycle.Running)
			want := map[string]string{"SECRET": orig["SECRET"], "CUBE_SANDBOX_ID": c.ID}
			wantMemory(t, svc, c.ID, want)
			holds(t, svc, c.ID, "vm-memory")
			if got := shell(t, svc, c.ID, `hostname; cat /root/file`); got != c.ID+"\non-disk" {
				t.Errorf("clone %s: hostname and file %q", c.ID, got)
			}
			mac := shell(t, svc, c.ID, `cat /sys/class/net/eth0/address`)
			if prev, dup := macs[mac]; dup || mac == "" {
				t.Errorf("clone %s: eth0 %q (also %s's)", c.ID, mac, prev)
			}
			macs[mac] = c.ID
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
		holds(t, svc, a.ID, "vm-memory")
	})

	t.Run("restart", func(t *testing.T) {
		// VMs outlive cubelet: a new one adopts the running VM and a
		// paused one from the driver's state, and reaches their agents.
		b := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "vm-b", Runtime: "vm"})
		if _, err := svc.Pause(ctx, b.ID); err != nil {
			t.Fatal(err)
		}
		pid := mustState(t, svc, a.ID, lifecycle.Running).Container.PID
		svc.Close()
		svc = env.Start(top) // lives on after this subtest
		if got := mustState(t, svc, a.ID, lifecycle.Running); got.Container.PID != pid {
			t.Fatalf("adopted with pid %d, was %d", got.Container.PID, pid)
		}
		holds(t, svc, a.ID, "vm-memory")
		mustState(t, svc, b.ID, lifecycle.Paused)
		if _, err := svc.Resume(ctx, b.ID); err != nil {
			t.Fatalf("resume after restart: %v", err)
		}
		if got := shell(t, svc, b.ID, `hostname`); got != b.ID {
			t.Fatalf("hostname %q", got)
		}
		if _, err := svc.Delete(ctx, b.ID); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("faults", func(t *testing.T) {
		inject(t, "rollback/container/after", "1*error")
		if _, err := svc.Rollback(ctx, cubelet.RollbackRequest{SandboxID: a.ID, SnapshotID: sn.ID}); !errors.Is(err, failpoint.ErrInjected) {
			t.Fatalf("rollback: want injected error, got %v", err)
		}
		failpoint.Disable("rollback/container/after")
		mustState(t, svc, a.ID, lifecycle.Running)
		for _, p := range points(svc, cubelet.FlowSnapshot) {
			inject(t, p, "1*error")
			if _, err := svc.Snapshot(ctx, cubelet.SnapshotRequest{SandboxID: a.ID, SnapshotID: "vm-never"}); !errors.Is(err, failpoint.ErrInjected) {
				t.Fatalf("%s: want injected error, got %v", p, err)
			}
			failpoint.Disable(p)
			mustState(t, svc, a.ID, lifecycle.Running)
		}
		for _, p := range []string{"clone/container/after", "clone/agent"} {
			inject(t, p, "1*error")
			if _, err := svc.Clone(ctx, cubelet.CloneRequest{SnapshotID: sn.ID, Count: 1}); !errors.Is(err, failpoint.ErrInjected) {
				t.Fatalf("%s: want injected error, got %v", p, err)
			}
			failpoint.Disable(p)
			if n := len(mustList(t, svc)); n != 1 {
				t.Fatalf("%s: %d sandboxes after a failed clone", p, n)
			}
		}
		holds(t, svc, a.ID, "vm-memory")
	})
}

// TestVMHungGuest: a VM whose guest never starts its agent fails its
// create within sandbox.agent_ready_max of wall time, with the guest's
// console tail in the error, and leaves no QEMU, socket, TAP, disk or
// state behind. The guest's initramfs runs a shell instead of /init
// (rdinit=/bin/sh): the kernel is up and QEMU lives on, but nothing ever
// answers the agent channel, and on a loaded host the CPU-share budget
// (120 s × 6 for TCG, times the load) alone would keep the create waiting
// for an hour or more. Control: the same node without rdinit boots within
// the same ceiling.
func TestVMHungGuest(t *testing.T) {
	const ceiling = 60 * time.Second
	sandboxTOML := fmt.Sprintf("agent_ready_max = %q\n", ceiling)
	create := func(t *testing.T, vmTOML string) (time.Duration, error) {
		env, svc := vmEnvWith(t, vmTOML, sandboxTOML)
		defer func() {
			for _, sb := range mustList(t, svc) {
				if _, err := svc.Delete(context.Background(), sb.ID); err != nil {
					t.Error(err)
				}
			}
			env.AssertNoLeaks(t)
		}()
		start := time.Now()
		_, err := svc.Create(context.Background(), cubelet.CreateRequest{SandboxID: "vm-hang", Runtime: "vm", TemplateID: "busybox"})
		took := time.Since(start)
		if err != nil {
			if sbs := mustList(t, svc); len(sbs) != 0 {
				t.Errorf("failed create left %d sandboxes", len(sbs))
			}
		}
		return took, err
	}
	t.Run("hung", func(t *testing.T) {
		took, err := create(t, `extra_cmdline = ["rdinit=/bin/sh"]`)
		t.Logf("guest without agent: create failed after %v: %v", took.Round(time.Millisecond), err)
		if err == nil {
			t.Fatal("create of a VM whose guest runs no agent succeeded")
		}
		for _, want := range []string{"agent_ready_max " + ceiling.String(), "guest console ends with"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("error does not say %q", want)
			}
		}
		// The wait, then the rollback: QEMU stopped (QMP quit, else
		// SIGKILL), disk, slot and state released; slower on a loaded host.
		if took < ceiling || took > ceiling+60*time.Second {
			t.Errorf("failed after %v, want about %v", took, ceiling)
		}
	})
	t.Run("control", func(t *testing.T) {
		took, err := create(t, "")
		if err != nil {
			t.Fatalf("control: the guest with its agent did not come up within %v: %v", ceiling, err)
		}
		t.Logf("control: same node without rdinit: agent ready after %v", took.Round(time.Millisecond))
	})
}

// TestVMWarmTemplate warms a template on the vm runtime and creates from
// it: the create restores the booted VM's memory image instead of booting.
func TestVMWarmTemplate(t *testing.T) {
	env, svc := vmEnv(t, "")
	ctx := context.Background()
	defer func() {
		for _, sb := range mustList(t, svc) {
			if _, err := svc.Delete(ctx, sb.ID); err != nil {
				t.Error(err)
			}
		}
		_ = svc.DeleteTemplate(ctx, "busybox")
		assertSnapshotFiles(t, env, svc)
		env.AssertNoLeaks(t)
	}()
	start := time.Now()
	if _, err := svc.WarmTemplate(ctx, "busybox", "vm"); err != nil {
		t.Fatalf("warm: %v", err)
	}
	t.Logf("warm template (boot + memory snapshot): %v", time.Since(start))
	for _, id := range []string{"vm-w1", "vm-w2"} {
		start := time.Now()
		r, err := svc.Create(ctx, cubelet.CreateRequest{SandboxID: id, TemplateID: "busybox", Env: map[string]string{"WHO": id}})
		if err != nil {
			t.Fatalf("create from warm template: %v", err)
		}
		t.Logf("create from warm template to agent ready: %v", time.Since(start))
		for _, tm := range r.Timings {
			t.Logf("  step %d %-10s %-5s %v %s", tm.Step, tm.Action, tm.Phase, tm.Duration, tm.Err)
		}
		if !r.Warm || r.Sandbox.Runtime != "vm" {
			t.Fatalf("create warm=%v runtime=%s", r.Warm, r.Sandbox.Runtime)
		}
		wantMemory(t, svc, id, map[string]string{"WHO": id, "CUBE_SANDBOX_ID": id})
		if got := shell(t, svc, id, `hostname`); got != id {
			t.Fatalf("hostname %q, want %s", got, id)
		}
	}
}
