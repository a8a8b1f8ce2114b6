package runc

import (
	"fmt"
	"os"
	goruntime "runtime"
	"testing"

	"golang.org/x/sys/unix"
)

// Work that joins a mount namespace runs on a thread that ends with it,
// never on the main thread, which the Go runtime would park for good in
// that namespace (pinning a sandbox's disk). The control shows the hazard
// is real: a goroutine started the plain way from here runs on the main
// thread most of the time.
func TestThrowawayThreadIsNeverTheMainThread(t *testing.T) {
	requireRoot(t)
	mainNS := func() string {
		l, err := os.Readlink(fmt.Sprintf("/proc/self/task/%d/ns/mnt", os.Getpid()))
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	before := mainNS()
	onMain := 0
	for range 100 {
		err := onThrowawayThread(func() error {
			if unix.Gettid() == unix.Getpid() {
				onMain++
			}
			return unix.Unshare(unix.CLONE_FS | unix.CLONE_NEWNS)
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if onMain > 0 {
		t.Errorf("%d of 100 ran on the main thread", onMain)
	}
	if after := mainNS(); after != before {
		t.Errorf("the main thread's mount namespace went from %s to %s", before, after)
	}

	// Control: a plain locked goroutine (unlocked again on the main
	// thread, so the process keeps it).
	plain := 0
	for range 100 {
		done := make(chan bool, 1)
		go func() {
			goruntime.LockOSThread()
			if unix.Gettid() == unix.Getpid() {
				goruntime.UnlockOSThread()
				done <- true
				return
			}
			done <- false
		}()
		if <-done {
			plain++
		}
	}
	if plain == 0 {
		t.Errorf("control: no plain goroutine of 100 ran on the main thread")
	}
	t.Logf("on the main thread: %d of 100 through onThrowawayThread, %d of 100 plain", onMain, plain)
}
