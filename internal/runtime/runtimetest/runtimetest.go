// Package runtimetest is the conformance suite every runtime.Driver runs.
// It checks the contract written on runtime.Driver through the public
// interface only, so a driver passes it without exposing internals.
//
// A driver's test calls Run with a constructor for a fresh driver and a
// constructor for a startable Spec:
//
//	func TestConformance(t *testing.T) {
//		runtimetest.Run(t, newDriver, newSpec)
//	}
//
// newSpec must return a Spec whose PID 1 keeps running until stopped, with
// its own BundleDir and CgroupPath for each id.
//
// CheckCapabilities is the part that starts nothing: a driver's test also
// calls it for configurations Run does not start (a driver with memory
// snapshots switched off).
package runtimetest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime"
)

// opTimeout bounds every single driver call in the suite.
const opTimeout = 30 * time.Second

// Run runs the whole suite as subtests of t.
func Run(t *testing.T, newDriver func(t *testing.T) runtime.Driver, newSpec func(t *testing.T, id string) runtime.Spec) {
	t.Helper()
	cases := []struct {
		name string
		fn   func(t *testing.T, d runtime.Driver, newSpec func(t *testing.T, id string) runtime.Spec)
	}{
		{"Capabilities", func(t *testing.T, d runtime.Driver, _ func(*testing.T, string) runtime.Spec) { CheckCapabilities(t, d) }},
		{"StartState", testStartState},
		{"DuplicateStart", testDuplicateStart},
		{"PauseResume", testPauseResume},
		{"Stop", testStop},
		{"StopIdempotent", testStopIdempotent},
		{"CancelledStart", testCancelledStart},
		{"Unsupported", testUnsupported},
		{"ConcurrentStart", testConcurrentStart},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			c.fn(t, newDriver(t), newSpec)
		})
	}
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), opTimeout)
	t.Cleanup(cancel)
	return ctx
}

// start starts id and registers its Stop as cleanup, so a failing
// assertion never leaks a sandbox.
func start(t *testing.T, d runtime.Driver, spec runtime.Spec) runtime.State {
	t.Helper()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
		defer cancel()
		if err := d.Stop(ctx, spec.ID); err != nil {
			t.Errorf("cleanup: Stop(%s): %v", spec.ID, err)
		}
	})
	st, err := d.Start(ctxT(t), spec)
	if err != nil {
		t.Fatalf("Start(%s): %v", spec.ID, err)
	}
	return st
}

func wantStatus(t *testing.T, d runtime.Driver, id string, want runtime.Status) runtime.State {
	t.Helper()
	st, err := d.State(ctxT(t), id)
	if err != nil {
		t.Fatalf("State(%s): %v", id, err)
	}
	if st.Status != want {
		t.Fatalf("State(%s).Status = %q, want %q", id, st.Status, want)
	}
	if st.ID != id {
		t.Fatalf("State(%s).ID = %q", id, st.ID)
	}
	return st
}

func wantGone(t *testing.T, d runtime.Driver, id string) {
	t.Helper()
	if st, err := d.State(ctxT(t), id); !errdefs.IsNotFound(err) {
		t.Fatalf("State(%s) = %+v, %v; want ErrNotFound", id, st, err)
	}
	if listed(t, d, id) {
		t.Fatalf("List still has %s", id)
	}
}

func listed(t *testing.T, d runtime.Driver, id string) bool {
	t.Helper()
	all, err := d.List(ctxT(t))
	if err != nil {
		t.Fatalf("List: %v", err)
	}
	return slices.ContainsFunc(all, func(s runtime.State) bool { return s.ID == id })
}

func testStartState(t *testing.T, d runtime.Driver, newSpec func(*testing.T, string) runtime.Spec) {
	id := "conf-start"
	st := start(t, d, newSpec(t, id))
	if st.PID <= 0 || st.Status != runtime.StatusRunning || st.ID != id {
		t.Fatalf("Start returned %+v, want running with a PID", st)
	}
	got := wantStatus(t, d, id, runtime.StatusRunning)
	if got.PID != st.PID {
		t.Fatalf("State PID %d, Start PID %d", got.PID, st.PID)
	}
	if !listed(t, d, id) {
		t.Fatalf("List misses %s", id)
	}
}

func testDuplicateStart(t *testing.T, d runtime.Driver, newSpec func(*testing.T, string) runtime.Spec) {
	id := "conf-dup"
	spec := newSpec(t, id)
	first := start(t, d, spec)
	_, err := d.Start(ctxT(t), spec)
	if !errdefs.IsAlreadyExists(err) {
		t.Fatalf("second Start(%s) = %v, want ErrAlreadyExists", id, err)
	}
	// The failed duplicate must not have rolled back the original.
	if st := wantStatus(t, d, id, runtime.StatusRunning); st.PID != first.PID {
		t.Fatalf("PID changed from %d to %d after duplicate Start", first.PID, st.PID)
	}
}

func testPauseResume(t *testing.T, d runtime.Driver, newSpec func(*testing.T, string) runtime.Spec) {
	if !d.Capabilities().Pause {
		t.Skip("driver cannot pause")
	}
	id := "conf-pause"
	start(t, d, newSpec(t, id))
	if err := d.Pause(ctxT(t), id); err != nil {
		t.Fatalf("Pause: %v", err)
	}
	wantStatus(t, d, id, runtime.StatusPaused)
	if err := d.Resume(ctxT(t), id); err != nil {
		t.Fatalf("Resume: %v", err)
	}
	wantStatus(t, d, id, runtime.StatusRunning)
	if err := d.Pause(ctxT(t), "conf-never-started"); !errdefs.IsNotFound(err) {
		t.Fatalf("Pause(absent) = %v, want ErrNotFound", err)
	}
	// Stopping a paused sandbox is the common path for idle reclaim.
	if err := d.Pause(ctxT(t), id); err != nil {
		t.Fatalf("Pause: %v", err)
	}
	if err := d.Stop(ctxT(t), id); err != nil {
		t.Fatalf("Stop(paused): %v", err)
	}
	wantGone(t, d, id)
}

func testStop(t *testing.T, d runtime.Driver, newSpec func(*testing.T, string) runtime.Spec) {
	id := "conf-stop"
	start(t, d, newSpec(t, id))
	if err := d.Stop(ctxT(t), id); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	wantGone(t, d, id)
}

func testStopIdempotent(t *testing.T, d runtime.Driver, newSpec func(*testing.T, string) runtime.Spec) {
	id := "conf-stop2"
	start(t, d, newSpec(t, id))
	for i := range 2 {
		if err := d.Stop(ctxT(t), id); err != nil {
			t.Fatalf("Stop #%d: %v", i+1, err)
		}
	}
	wantGone(t, d, id)
	if err := d.Stop(ctxT(t), "conf-never-started"); err != nil {
		t.Fatalf("Stop(never started) = %v, want nil", err)
	}
	if _, err := d.State(ctxT(t), "conf-never-started"); !errdefs.IsNotFound(err) {
		t.Fatalf("State(never started) = %v, want ErrNotFound", err)
	}
}

func testCancelledStart(t *testing.T, d runtime.Driver, newSpec func(*testing.T, string) runtime.Spec) {
	id := "conf-cancel"
	spec := newSpec(t, id)
	t.Cleanup(func() { _ = d.Stop(context.Background(), id) })
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, err := d.Start(ctx, spec); err == nil {
		t.Fatal("Start with a cancelled ctx succeeded")
	} else if !errors.Is(err, context.Canceled) {
		t.Fatalf("Start with a cancelled ctx = %v, want context.Canceled", err)
	}
	wantGone(t, d, id)
}

func testUnsupported(t *testing.T, d runtime.Driver, newSpec func(*testing.T, string) runtime.Spec) {
	caps := d.Capabilities()
	check := func(verb string, supported bool, err error) {
		t.Helper()
		if got := errdefs.IsNotImplemented(err); got == supported {
			t.Errorf("%s: Capabilities says %v, but error is %v", verb, supported, err)
		}
	}
	id := "conf-caps"
	spec := newSpec(t, id)
	start(t, d, spec)
	check("Checkpoint", caps.Checkpoint, d.Checkpoint(ctxT(t), id, t.TempDir(), true))
	check("Pause", caps.Pause, d.Pause(ctxT(t), id))
	if caps.Pause {
		if err := d.Resume(ctxT(t), id); err != nil {
			t.Fatalf("Resume: %v", err)
		}
	} else {
		check("Resume", false, d.Resume(ctxT(t), id))
	}
	restoreSpec := newSpec(t, id+"-restored")
	t.Cleanup(func() { _ = d.Stop(context.Background(), restoreSpec.ID) })
	_, err := d.Restore(ctxT(t), restoreSpec, t.TempDir())
	check("Restore", caps.Restore, err)
}

// CheckCapabilities checks, without starting a sandbox, that d's
// Capabilities agree with its verbs: a verb reported false returns
// errdefs.ErrNotImplemented, and one reported true, called for an absent
// sandbox, returns errdefs.ErrNotFound instead. Resume follows Pause,
// Restore is reported only with Checkpoint (the image it reads is one
// Checkpoint wrote), and the optional InPlaceRestorer follows Restore.
// Name must be set and Capabilities must not change between calls.
func CheckCapabilities(t *testing.T, d runtime.Driver) {
	t.Helper()
	for _, p := range capabilityProblems(ctxT(t), d, t.TempDir) {
		t.Error(p)
	}
}

// capabilityProblems is CheckCapabilities' work, one line per mismatch;
// tempDir gives a fresh directory for each verb that takes one.
func capabilityProblems(ctx context.Context, d runtime.Driver, tempDir func() string) []string {
	var out []string
	if d.Name() == "" {
		out = append(out, "Name is empty")
	}
	caps := d.Capabilities()
	if again := d.Capabilities(); again != caps {
		out = append(out, fmt.Sprintf("Capabilities changed between calls: %+v, then %+v", caps, again))
	}
	if caps.Restore && !caps.Checkpoint {
		out = append(out, fmt.Sprintf("Capabilities %+v: Restore without Checkpoint", caps))
	}
	const absent = "conf-absent"
	check := func(verb string, supported bool, err error) {
		switch {
		case !supported && !errdefs.IsNotImplemented(err):
			out = append(out, fmt.Sprintf("%s: Capabilities says unsupported, but error is %v; want ErrNotImplemented", verb, err))
		case supported && !errdefs.IsNotFound(err):
			out = append(out, fmt.Sprintf("%s(absent): error is %v; want ErrNotFound", verb, err))
		}
	}
	check("Pause", caps.Pause, d.Pause(ctx, absent))
	check("Resume", caps.Pause, d.Resume(ctx, absent))
	check("Checkpoint", caps.Checkpoint, d.Checkpoint(ctx, absent, tempDir(), false))
	if !caps.Restore {
		// A supported Restore is a start; testUnsupported covers it.
		_, err := d.Restore(ctx, runtime.Spec{ID: absent}, tempDir())
		check("Restore", false, err)
	}
	if r, ok := d.(runtime.InPlaceRestorer); ok {
		_, err := r.RestoreInPlace(ctx, absent, tempDir())
		check("RestoreInPlace", caps.Restore, err)
	}
	return out
}

func testConcurrentStart(t *testing.T, d runtime.Driver, newSpec func(*testing.T, string) runtime.Spec) {
	const n = 10
	specs := make([]runtime.Spec, n)
	for i := range specs {
		specs[i] = newSpec(t, fmt.Sprintf("conf-par-%d", i))
		id := specs[i].ID
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
			defer cancel()
			if err := d.Stop(ctx, id); err != nil {
				t.Errorf("cleanup: Stop(%s): %v", id, err)
			}
		})
	}
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range specs {
		wg.Go(func() { _, errs[i] = d.Start(ctxT(t), specs[i]) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("concurrent Start: %v", err)
	}
	for _, s := range specs {
		wantStatus(t, d, s.ID, runtime.StatusRunning)
	}
	for i := range specs {
		wg.Go(func() { errs[i] = d.Stop(ctxT(t), specs[i].ID) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("concurrent Stop: %v", err)
	}
	for _, s := range specs {
		wantGone(t, d, s.ID)
	}
}
