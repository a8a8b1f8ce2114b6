// Package forkthread starts child processes from one OS thread that lives
// as long as the process.
//
// The kernel sends a child's parent-death signal (Pdeathsig) when the
// thread that forked it exits, not the process, and the Go runtime ends a
// thread when a goroutine locked to it returns without unlocking (what
// code that enters a network namespace does). A child started from such a
// thread would be killed while its parent runs on. Children started here
// get their parent-death signal only when the process ends.
package forkthread

import (
	"os/exec"
	"runtime"
	"sync"
)

var (
	once sync.Once
	reqs chan func()
)

// Do runs f on the fork thread.
func Do(f func() error) error {
	once.Do(func() {
		reqs = make(chan func())
		go func() {
			runtime.LockOSThread() // never unlocked: the thread lives as long as the process
			for r := range reqs {
				r()
			}
		}()
	})
	errc := make(chan error, 1)
	reqs <- func() { errc <- f() }
	return <-errc
}

// Start starts cmd on the fork thread.
func Start(cmd *exec.Cmd) error { return Do(cmd.Start) }
