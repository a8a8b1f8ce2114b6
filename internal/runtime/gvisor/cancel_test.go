package gvisor

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime/cgroups"
)

// TestCancelledStartLeavesNothing cancels Start at points spread over
// runsc's start (before it forks the sandbox, between the fork and its
// state file, after). Whatever the point, the call either succeeds or
// leaves no runsc state, no process of the sandbox and no cgroup: a runsc
// killed mid-start used to leave its sandbox and gofer running in a
// cgroup no rollback could remove.
func TestCancelledStartLeavesNothing(t *testing.T) {
	requireRunsc(t)
	d, parent := newTestDriver(t), cgroupParent(t)
	for i, ms := range []int{5, 20, 40, 80, 150, 300} {
		delay := time.Duration(ms) * time.Millisecond
		spec := shellSpec(t, parent, fmt.Sprintf("cancel-%d", i), "sleep 1000")
		stopAtEnd(t, d, spec.ID)
		ctx, cancel := context.WithTimeout(t.Context(), delay)
		_, err := d.Start(ctx, spec)
		cancel()
		if err == nil {
			t.Logf("cancel after %s: start finished first", delay)
			continue
		}
		if _, serr := d.State(t.Context(), spec.ID); !errdefs.IsNotFound(serr) {
			t.Fatalf("cancel after %s (%v): State = %v, want NotFound", delay, err, serr)
		}
		if dirs, _ := cgroups.Dirs(spec.CgroupPath); len(dirs) != 0 {
			t.Fatalf("cancel after %s (%v): cgroup left: %v", delay, err, dirs)
		}
		if pids := runscProcs(d.root); len(pids) != 0 {
			t.Fatalf("cancel after %s (%v): runsc processes left: %v", delay, err, pids)
		}
		t.Logf("cancel after %s: %v; nothing left", delay, err)
	}
}

// TestStopKillsStrayCgroupProcesses puts a process runsc does not know of
// into a sandbox's cgroup (what a runsc cut off mid-start leaves: a
// sandbox or gofer its state file never recorded) and stops the sandbox:
// Stop kills it and removes the cgroup. runsc's delete alone leaves it
// running and the cgroup busy, so the removal failed.
func TestStopKillsStrayCgroupProcesses(t *testing.T) {
	requireRunsc(t)
	d, parent := newTestDriver(t), cgroupParent(t)
	spec := shellSpec(t, parent, "stray", "sleep 1000")
	stopAtEnd(t, d, spec.ID)
	if _, err := d.Start(t.Context(), spec); err != nil {
		t.Fatal(err)
	}
	stray := exec.Command("sleep", "1000")
	if err := stray.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- stray.Wait() }()
	t.Cleanup(func() { _ = stray.Process.Kill() })
	dirs, err := cgroups.Dirs(spec.CgroupPath)
	if err != nil || len(dirs) == 0 {
		t.Fatalf("cgroup dirs of %s: %v %v", spec.CgroupPath, dirs, err)
	}
	moved := 0
	for _, dir := range dirs {
		if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(stray.Process.Pid)), 0o644); err == nil {
			moved++
		}
	}
	if moved == 0 {
		t.Fatalf("could not move pid %d into any of %v", stray.Process.Pid, dirs)
	}
	t.Logf("stray pid %d moved into %d of %d cgroup dirs", stray.Process.Pid, moved, len(dirs))
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if err := d.Stop(ctx, spec.ID); err != nil {
		t.Fatalf("Stop with a stray process in the cgroup: %v", err)
	}
	if left, _ := cgroups.Dirs(spec.CgroupPath); len(left) != 0 {
		t.Fatalf("cgroup left after Stop: %v", left)
	}
	select {
	case werr := <-exited:
		t.Logf("stray process ended: %v", werr)
	case <-time.After(5 * time.Second):
		t.Fatal("stray process still running after Stop")
	}
}

// TestStopSparesReusedPIDs: a checkpoint stops the sandbox, and its PIDs
// in runsc's state are free for other processes (on a host whose PIDs wrap
// within seconds, soon taken). The test hands them to a bystander process
// (it writes the bystander's PID into the state, as a reuse would) and
// stops the sandbox: the bystander lives. runsc's delete SIGKILLed the
// recorded PIDs unchecked, which killed other sandboxes in the chaos soak.
func TestStopSparesReusedPIDs(t *testing.T) {
	requireRunsc(t)
	d, parent := newTestDriver(t), cgroupParent(t)
	spec := shellSpec(t, parent, "reuse", "sleep 1000")
	stopAtEnd(t, d, spec.ID)
	if _, err := d.Start(t.Context(), spec); err != nil {
		t.Fatal(err)
	}
	if err := d.Checkpoint(t.Context(), spec.ID, t.TempDir(), false); err != nil {
		t.Fatal(err)
	}
	bystander := exec.Command("sleep", "1000")
	if err := bystander.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- bystander.Wait() }()
	t.Cleanup(func() { _ = bystander.Process.Kill() })
	path := filepath.Join(d.root, runscID(spec.ID)+"_sandbox:"+runscID(spec.ID)+".state")
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var st map[string]any
	if err := json.Unmarshal(b, &st); err != nil {
		t.Fatal(err)
	}
	pid := bystander.Process.Pid
	st["goferPid"] = pid
	st["sandbox"].(map[string]any)["pid"] = pid
	if b, err = json.Marshal(st); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Logf("stopped sandbox's recorded PIDs now name bystander %d", pid)
	if err := d.Stop(t.Context(), spec.ID); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	select {
	case werr := <-exited:
		t.Fatalf("the bystander holding the stale PIDs was killed by Stop: %v", werr)
	case <-time.After(time.Second):
		t.Logf("bystander %d alive after Stop", pid)
	}
}
