package runc

import (
	goruntime "runtime"

	"golang.org/x/sys/unix"
)

// onThrowawayThread runs f on an OS thread locked to it and ended after
// it, for work that leaves the thread in a state no other goroutine may
// inherit (another namespace, an unshared root). Never on the process's
// main thread: the Go runtime does not end that one when its goroutine
// exits locked but parks it for good, still in whatever f joined. A
// sandbox's mount namespace would stay pinned, and its disk with it, and
// /proc/self, which is the main thread's, would show that sandbox's
// mounts to every reader of /proc/self/mountinfo (cgroups finds the
// hierarchies there).
func onThrowawayThread(f func() error) error {
	errc := make(chan error, 1)
	go func() {
		goruntime.LockOSThread() // never unlocked but on the main thread: the thread ends with this goroutine
		if unix.Gettid() == unix.Getpid() {
			// Held here, the main thread cannot run the goroutine the
			// retry starts.
			errc <- onThrowawayThread(f)
			goruntime.UnlockOSThread()
			return
		}
		errc <- f()
	}()
	return <-errc
}
