package launcher

import (
	"io"
	"log/slog"
	"os/exec"
	"runtime"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestChildOutlivesItsStartingThread: a daemon started (with its
// parent-death signal) from a goroutine whose OS thread then ends keeps
// running, because children are forked from the launcher's fork thread.
// The control starts the same child with the same attributes directly on
// that goroutine: the thread's end delivers SIGTERM.
func TestChildOutlivesItsStartingThread(t *testing.T) {
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Skip("no sleep binary")
	}
	// startOnDyingThread runs start on a goroutine locked to its thread,
	// which exits with it (the runtime ends the thread).
	// The process's main thread is never ended (the runtime parks it
	// instead), so a goroutine that finds itself there tries again.
	startOnDyingThread := func(start func() (*exec.Cmd, error)) *exec.Cmd {
		for {
			res := make(chan *exec.Cmd, 1)
			retry := make(chan bool, 1)
			go func() {
				runtime.LockOSThread() // never unlocked: the thread ends here
				if unix.Gettid() == unix.Getpid() {
					runtime.UnlockOSThread()
					retry <- true
					return
				}
				retry <- false
				cmd, err := start()
				if err != nil {
					t.Error(err)
				}
				res <- cmd
			}()
			if !<-retry {
				return <-res
			}
		}
	}
	exitedWithin := func(cmd *exec.Cmd, d time.Duration) (bool, error) {
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case err := <-done:
			return true, err
		case <-time.After(d):
			_ = cmd.Process.Kill()
			return false, <-done
		}
	}

	c := &child{name: "sleep", path: sleep, args: []string{"30"}, out: io.Discard, log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	cmd := startOnDyingThread(func() (*exec.Cmd, error) { err := c.start(); return c.cmd, err })
	if cmd == nil {
		t.FailNow()
	}
	c.mu.Lock()
	exited := c.exited
	c.mu.Unlock()
	select {
	case <-exited:
		t.Fatalf("the child died after the thread that asked for it ended: %v", cmd.ProcessState)
	case <-time.After(2 * time.Second):
	}
	_ = cmd.Process.Kill()
	<-exited
	t.Log("child started through the fork thread: alive 2 s after its caller's thread ended")

	control := startOnDyingThread(func() (*exec.Cmd, error) {
		cmd := exec.Command(sleep, "30")
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
		err := cmd.Start()
		return cmd, err
	})
	if control == nil {
		t.FailNow()
	}
	died, err := exitedWithin(control, 5*time.Second)
	if !died {
		t.Fatal("control: a child forked on the ending thread itself kept running (no parent-death signal?)")
	}
	t.Logf("control: a child forked on the ending thread itself: %v", err)
}
