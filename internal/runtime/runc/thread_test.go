package runc

import (
	"fmt"
	"os"
	"os/exec"
	goruntime "runtime"
	"testing"

	"golang.org/x/sys/unix"
)

// threadProbeEnv makes TestThrowawayThreadIsNeverTheMainThread measure,
// in the process it re-executes.
const threadProbeEnv = "CUBE_TEST_THREAD_PROBE"

// Work that joins a mount namespace runs on a thread that ends with it,
// never on the main thread, which the Go runtime would park for good in
// that namespace (pinning a sandbox's disk). The control shows the hazard
// is real: a goroutine started the plain way runs on the main thread
// most of the time. Measured in a fresh process: in this one an earlier
// test may have taken the main thread for good (a goroutine that locks it
// and lives as long as the process), and the control would find it busy.
func TestThrowawayThreadIsNeverTheMainThread(t *testing.T) {
	requireRoot(t)
	if os.Getenv(threadProbeEnv) == "" {
		cmd := exec.Command(os.Args[0], "-test.run=^TestThrowawayThreadIsNeverTheMainThread$", "-test.count=1")
		cmd.Env = append(os.Environ(), threadProbeEnv+"=1")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("probe: %v\n%s", err, out)
		}
		var onMain, plain int
		if _, err := fmt.Sscanf(string(out), "on the main thread: %d through onThrowawayThread, %d plain", &onMain, &plain); err != nil {
			t.Fatalf("probe output %q: %v", out, err)
		}
		if onMain > 0 {
			t.Errorf("%d of 100 ran on the main thread", onMain)
		}
		if plain == 0 {
			t.Errorf("control: no plain goroutine of 100 ran on the main thread")
		}
		t.Logf("on the main thread: %d of 100 through onThrowawayThread, %d of 100 plain", onMain, plain)
		return
	}

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
	if after := mainNS(); after != before {
		t.Fatalf("the main thread's mount namespace went from %s to %s", before, after)
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
	fmt.Printf("on the main thread: %d through onThrowawayThread, %d plain\n", onMain, plain)
}
