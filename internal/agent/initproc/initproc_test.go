package initproc

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/testenv"
	"golang.org/x/sys/unix"
)

// supervise runs Supervise for the duration of t and returns its result
// channel.
func supervise(t *testing.T, r *Reaper) <-chan error {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		done <- Supervise(ctx, Config{Reaper: r, Logger: slog.Default(), Grace: 2 * time.Second})
	}()
	t.Cleanup(func() {
		cancel()
		<-finished
	})
	return done
}

// subreaper makes the test process inherit its grandchildren, as PID 1
// does, so orphan reaping can be observed.
func subreaper(t *testing.T) {
	t.Helper()
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		testenv.Missing(t, "PR_SET_CHILD_SUBREAPER: %v", err)
	}
	t.Cleanup(func() { _ = unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0) })
}

// zombieChildren lists our children in state Z.
func zombieChildren(t *testing.T) []int {
	t.Helper()
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	me := os.Getpid()
	var zs []int
	for _, p := range stats {
		b, err := os.ReadFile(p)
		if err != nil {
			continue // exited meanwhile
		}
		// pid (comm) state ppid ...; comm may contain spaces.
		s := string(b)
		rest := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
		if len(rest) < 2 {
			continue
		}
		if ppid, _ := strconv.Atoi(rest[1]); ppid == me && rest[0] == "Z" {
			pid, _ := strconv.Atoi(strings.Fields(s)[0])
			zs = append(zs, pid)
		}
	}
	return zs
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestReaperKeepsExitStatusOfStartedProcesses(t *testing.T) {
	subreaper(t)
	r := NewReaper(nil)
	supervise(t, r)

	// Exit codes of started children must survive concurrent reaping of
	// orphans that other children leave behind.
	const n = 20
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			script := fmt.Sprintf("sleep 0.0%d & exit %d", i%10, i)
			p, err := r.Start(exec.Command("/bin/sh", "-c", script))
			if err != nil {
				t.Error(err)
				return
			}
			if got := p.Wait().Code(); got != i {
				t.Errorf("child %d exit code = %d, want %d", i, got, i)
			}
		})
	}
	wg.Wait()
	eventually(t, "orphans reaped", func() bool { return r.Orphans() >= n && len(zombieChildren(t)) == 0 })
}

func TestCrashingChildDoesNotStopSupervisor(t *testing.T) {
	r := NewReaper(nil)
	done := supervise(t, r)
	p, err := r.Start(exec.Command("/bin/sh", "-c", "kill -SEGV $$"))
	if err != nil {
		t.Fatal(err)
	}
	if got := p.Wait().Code(); got != 128+int(unix.SIGSEGV) {
		t.Fatalf("exit code = %d, want %d", got, 128+int(unix.SIGSEGV))
	}
	select {
	case err := <-done:
		t.Fatalf("Supervise returned after a child crashed: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	if zs := zombieChildren(t); len(zs) != 0 {
		t.Fatalf("zombies left: %v", zs)
	}
}

func TestSIGTERMForwardedAndSupervisorExits(t *testing.T) {
	// Our own handler keeps the test binary alive whatever the timing of
	// Supervise's signal.Notify.
	guard := make(chan os.Signal, 8)
	signal.Notify(guard, unix.SIGTERM)
	t.Cleanup(func() { signal.Stop(guard) })

	r := NewReaper(nil)
	done := supervise(t, r)
	p, err := r.Start(exec.Command("/bin/sleep", "100"))
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.After(5 * time.Second)
	for {
		if err := unix.Kill(os.Getpid(), unix.SIGTERM); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("Supervise: %v", err)
			}
			if got := p.Wait().Code(); got != 128+int(unix.SIGTERM) {
				t.Fatalf("child exit code = %d, want SIGTERM", got)
			}
			return
		case <-deadline:
			t.Fatal("Supervise did not return after SIGTERM")
		case <-time.After(100 * time.Millisecond):
		}
	}
}
