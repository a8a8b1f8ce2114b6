package gvisor

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/testenv"
)

// sleeper starts `sleep 1000` in cgroup path cg (the pids hierarchy,
// made here) and returns it; the process and the cgroup go when t ends.
func sleeper(t *testing.T, cg string) *exec.Cmd {
	t.Helper()
	dir := filepath.Join("/sys/fs/cgroup/pids", cg)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Skipf("no cgroup v1 pids hierarchy: %v", err)
	}
	cmd := exec.Command("sleep", "1000")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		_ = os.Remove(dir)
	})
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(cmd.Process.Pid)), 0); err != nil {
		t.Fatal(err)
	}
	return cmd
}

// TestAwaitExit: the pidfds retire keeps for a slot make the next launch
// into it wait until the retired processes have exited. A process in the
// cgroup killed by killPidfds is waited for and found dead; the control
// keeps the pidfd of a live process that nothing killed: awaitExit does
// not return until its ctx ends (so the wait is a real one), and returns
// once the process is killed.
func TestAwaitExit(t *testing.T) {
	testenv.RequireRoot(t, "moves a process into a cgroup")
	d, parent := newTestDriver(t), cgroupParent(t)
	cg := parent + "/exit"
	cmd := sleeper(t, cg)
	fds := killPidfds(cg)
	if len(fds) != 1 {
		t.Fatalf("killPidfds signalled %d processes, want the 1 in %s", len(fds), cg)
	}
	d.keepDying("x.", fds)
	begin := time.Now()
	if err := d.awaitExit(t.Context(), "x."); err != nil {
		t.Fatalf("awaitExit after SIGKILL: %v", err)
	}
	err := cmd.Wait()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("the process ended with %v, want SIGKILL", err)
	}
	t.Logf("killed process waited for in %s", time.Since(begin).Round(time.Microsecond))
	if len(d.dying) != 0 {
		t.Fatalf("pidfds still kept after the wait: %v", d.dying)
	}

	// Control: a live process nobody killed keeps the wait going.
	live := sleeper(t, parent+"/live")
	fd, err := unix.PidfdOpen(live.Process.Pid, 0)
	if err != nil {
		t.Fatal(err)
	}
	d.keepDying("y.", []int{fd})
	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	err = d.awaitExit(ctx, "y.")
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("awaitExit on a live process: %v, want it to wait until ctx ends", err)
	}
	t.Logf("control: a live process kept awaitExit waiting: %v", err)
	if errdefs.IsUnavailable(err) {
		t.Fatalf("ctx end reported as the exit bound: %v", err)
	}
}
