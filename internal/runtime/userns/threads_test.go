package userns

import (
	"context"
	"os/exec"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/testenv"
)

// churnThreads keeps ending OS threads until ctx is done: goroutines that
// lock their thread and return without unlocking, as code entering a
// network or UTS namespace does. The runtime hands them idle threads,
// among them ones that forked a child a moment before.
func churnThreads(ctx context.Context, wg *sync.WaitGroup) {
	for range 4 {
		wg.Go(func() {
			for ctx.Err() == nil {
				done := make(chan struct{})
				go func() {
					runtime.LockOSThread()
					time.Sleep(50 * time.Microsecond)
					close(done)
				}()
				<-done
			}
		})
	}
}

// newNamespaces makes n namespaces while threads churn and counts those
// that failed.
func newNamespaces(t *testing.T, n int) (failed int, last error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	churnThreads(ctx, &wg)
	defer func() { cancel(); wg.Wait() }()
	r := Range{HostID: DefaultFirst, Size: Size}
	for range n {
		ns, err := NewNamespace(r, map[string]int{"max_user_namespaces": 0})
		if err != nil {
			failed, last = failed+1, err
			continue
		}
		ns.Close()
	}
	return failed, last
}

// A namespace's helper is killed with its parent-death signal when the
// thread that forked it ends, not the process. Started from forkthread's
// thread, which never ends, every namespace is made while other
// goroutines end threads all along. The control starts the helper from
// the caller's thread, as exec.Cmd.Start does, and loses some.
func TestNewNamespaceWhileThreadsEnd(t *testing.T) {
	testenv.RequireRoot(t, "the helper runs as the range's base UID")
	const n = 150
	failed, last := newNamespaces(t, n)
	if failed > 0 {
		t.Fatalf("%d of %d namespaces failed while threads ended; last: %v", failed, n, last)
	}
	t.Logf("%d of %d namespaces made while threads ended", n, n)

	saved := startHelper
	startHelper = (*exec.Cmd).Start
	t.Cleanup(func() { startHelper = saved })
	failed, last = newNamespaces(t, n)
	if failed == 0 {
		t.Fatalf("control: all %d namespaces made with the helper forked from the caller's thread; the churn does not reach it", n)
	}
	t.Logf("control (helper forked from the caller's thread): %d of %d failed; last: %v", failed, n, last)
}
