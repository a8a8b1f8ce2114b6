package gvisor

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime"
)

// TestPauseResumeWithoutRunsc: the driver pauses and resumes through the
// sentry's control socket (setPaused), and runsc agrees with the result:
// `runsc state` reports each status, the sandbox's processes stop and go
// on, and runsc's own pause and resume still work on the state file the
// driver rewrote. A pause of a paused sandbox and a resume of a running
// one are refused (FailedPrecondition) and the sandbox runs on; the
// control is the same resume sent to the sentry without that guard,
// which kills the sandbox.
func TestPauseResumeWithoutRunsc(t *testing.T) {
	requireRunsc(t)
	d, parent := newTestDriver(t), cgroupParent(t)
	ctx := t.Context()
	id := "ctl-a"
	spec := shellSpec(t, parent, id, `i=0; while true; do i=$((i+1)); echo $i > /count; sleep 0.01; done`)
	stopAtEnd(t, d, id)
	if _, err := d.Start(ctx, spec); err != nil {
		t.Fatal(err)
	}
	count := func() int {
		b, _ := os.ReadFile(filepath.Join(spec.RootFS, "count"))
		n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
		return n
	}
	// advancing reports whether the counter moves within a second.
	advancing := func() bool {
		first := count()
		for range 100 {
			time.Sleep(10 * time.Millisecond)
			if count() > first {
				return true
			}
		}
		return false
	}
	runscSays := func(want string) {
		t.Helper()
		c, err := d.rsc("none", "").State(ctx, runscID(id))
		if err != nil || c.Status != want {
			t.Fatalf("runsc state = %+v, %v; want %s", c, err, want)
		}
	}
	if !advancing() {
		t.Fatal("the counter never moved after Start")
	}

	for round := range 3 {
		begin := time.Now()
		if err := d.Pause(ctx, id); err != nil {
			t.Fatalf("Pause: %v", err)
		}
		paused := time.Since(begin)
		runscSays("paused")
		if advancing() {
			t.Fatal("the counter moved while paused")
		}
		begin = time.Now()
		if err := d.Resume(ctx, id); err != nil {
			t.Fatalf("Resume: %v", err)
		}
		resumed := time.Since(begin)
		runscSays("running")
		if !advancing() {
			t.Fatal("the counter did not move after Resume")
		}
		t.Logf("round %d: pause %v, resume %v", round, paused, resumed)
	}

	// runsc's own verbs on the file the driver rewrote, for comparison.
	begin := time.Now()
	if err := d.rsc("none", "").Pause(ctx, runscID(id)); err != nil {
		t.Fatalf("runsc pause after the driver's resume: %v", err)
	}
	mid := time.Now()
	if err := d.rsc("none", "").Resume(ctx, runscID(id)); err != nil {
		t.Fatalf("runsc resume: %v", err)
	}
	t.Logf("runsc pause %v, runsc resume %v", mid.Sub(begin), time.Since(mid))
	runscSays("running")

	// Unbalanced calls are refused and leave the sandbox running.
	if err := d.Resume(ctx, id); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("Resume of a running sandbox: %v, want FailedPrecondition", err)
	}
	if err := d.Pause(ctx, id); err != nil {
		t.Fatal(err)
	}
	if err := d.Pause(ctx, id); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("Pause of a paused sandbox: %v, want FailedPrecondition", err)
	}
	if err := d.Resume(ctx, id); err != nil {
		t.Fatal(err)
	}
	if st, err := d.State(ctx, id); err != nil || st.Status != runtime.StatusRunning || !advancing() {
		t.Fatalf("after the refused calls: %+v, %v; want running and counting", st, err)
	}

	// Control: the resume without the state file's guard.
	_, err := sentryCall(ctx, runscID(id), methodResume)
	t.Logf("unguarded resume of a running sandbox: %v", err)
	deadline := time.Now().Add(5 * time.Second)
	for {
		st, err := d.State(ctx, id)
		if err == nil && st.Status == runtime.StatusStopped {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("control: the sandbox survived an unguarded resume (%+v, %v); the guard is not what keeps it alive", st, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
