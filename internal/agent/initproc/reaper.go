// Package initproc does what PID 1 must do inside a sandbox: reap every
// zombie, forward termination signals to the rest of the sandbox, and shut
// down only once its children are gone.
//
// # Reaping without stealing exit statuses
//
// PID 1 inherits every orphan, so it must call wait4(-1). That races with
// exec.Cmd.Wait for processes the agent starts itself: whichever waits first
// gets the status and the other sees ECHILD. The Reaper removes the race by
// being the only waiter in the process:
//
//   - Processes the agent starts go through Reaper.Start, which forks while
//     holding the reaper's lock and registers the PID before releasing it.
//     The reap loop takes the same lock, so it can never reap a PID before
//     its waiter is registered.
//   - The reap loop (on every SIGCHLD) calls wait4(-1, WNOHANG) until no
//     zombie is left, delivering each status to the registered waiter, or
//     dropping it (after a debug log) for orphans nobody waits on.
//   - Callers wait with Process.Wait, never exec.Cmd.Wait. Consequently
//     exec.Cmd's own I/O copying goroutines are never joined: give Start
//     commands whose Stdin/Stdout/Stderr are *os.File (pipes, PTYs, files)
//     or nil.
package initproc

import (
	"errors"
	"fmt"
	"log/slog"
	"os/exec"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Exit is how a child ended.
type Exit struct {
	Pid    int
	Status unix.WaitStatus
	Time   time.Time
}

// Code is the shell-style exit code: the exit status, or 128+signal.
func (e Exit) Code() int {
	if e.Status.Signaled() {
		return 128 + int(e.Status.Signal())
	}
	return e.Status.ExitStatus()
}

// Process is a child started through Reaper.Start.
type Process struct {
	Pid  int
	done chan struct{}
	exit Exit
}

// Wait blocks until the process has exited and been reaped.
func (p *Process) Wait() Exit {
	<-p.done
	return p.exit
}

// Done is closed once the process has been reaped.
func (p *Process) Done() <-chan struct{} { return p.done }

// Reaper owns wait4 for the whole process. Create one per process.
type Reaper struct {
	log *slog.Logger

	mu      sync.Mutex
	waiters map[int]*Process // PIDs started through Start and not yet reaped
	orphans int              // reaped PIDs nobody waited on, for tests and metrics
}

// NewReaper returns a Reaper. It does nothing until Reap is called;
// Supervise calls it on every SIGCHLD.
func NewReaper(log *slog.Logger) *Reaper {
	if log == nil {
		log = slog.Default()
	}
	return &Reaper{log: log, waiters: make(map[int]*Process)}
}

// Start starts cmd and registers it so its exit status is kept for
// Process.Wait. Do not call cmd.Wait, and do not use cmd.Process
// afterwards: its handle is released (signal by PID instead).
func (r *Reaper) Start(cmd *exec.Cmd) (*Process, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &Process{Pid: cmd.Process.Pid, done: make(chan struct{})}
	// We wait by PID, never through os.Process, whose handle (a pidfd)
	// would otherwise hold a descriptor until garbage collection.
	_ = cmd.Process.Release()
	r.waiters[p.Pid] = p
	return p, nil
}

// Reap collects every child that has exited so far without blocking. It
// reports whether the process has no children left at all.
func (r *Reaper) Reap() (noChildren bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, unix.WNOHANG, nil)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if errors.Is(err, unix.ECHILD) {
			return true
		}
		if err != nil {
			r.log.Warn("wait4", "error", err)
			return false
		}
		if pid <= 0 {
			return false // children exist, none has exited
		}
		e := Exit{Pid: pid, Status: ws, Time: time.Now()}
		if p, ok := r.waiters[pid]; ok {
			delete(r.waiters, pid)
			p.exit = e
			close(p.done)
			continue
		}
		r.orphans++
		r.log.Debug("reaped orphan", "pid", pid, "code", e.Code())
	}
}

// Orphans returns how many children were reaped that nobody waited on.
func (r *Reaper) Orphans() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.orphans
}

// signalTracked sends sig to every process started through Start that has
// not been reaped yet.
func (r *Reaper) signalTracked(sig unix.Signal) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	var errs []error
	for pid := range r.waiters {
		if err := unix.Kill(pid, sig); err != nil && !errors.Is(err, unix.ESRCH) {
			errs = append(errs, fmt.Errorf("kill %d: %w", pid, err))
		}
	}
	return errors.Join(errs...)
}
