package workflow

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// gate is an action that blocks in Create until release is closed, and
// reports each entry on entered.
func gate(name string, entered chan<- struct{}, release <-chan struct{}) *fake {
	return &fake{name: name, create: func(ctx context.Context, _ *task) error {
		entered <- struct{}{}
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}}
}

func waitN(t *testing.T, ch <-chan struct{}, n int) {
	t.Helper()
	for range n {
		select {
		case <-ch:
		case <-time.After(5 * time.Second):
			t.Fatalf("timed out waiting for %d entries", n)
		}
	}
}

// TestLimiter: limit 10, 50 concurrent runs blocked in an action: exactly 10
// in flight, 40 rejected with ResourceExhausted without waiting, none hang.
func TestLimiter(t *testing.T) {
	entered := make(chan struct{}, 50)
	release := make(chan struct{})
	prom := prometheus.NewPedanticRegistry()
	e := newEngine(t, newRegistry(t, nil, gate("block", entered, release)),
		Config{"create": {Limit: 10, Steps: [][]string{{"block"}}}}, WithMetrics(prom, "cube"))

	errs := make(chan error, 50)
	var wg sync.WaitGroup
	for range 50 {
		wg.Go(func() {
			_, err := e.Run(context.Background(), "create", &task{})
			errs <- err
		})
	}
	// The 40 rejections must all come back while the 10 are still blocked.
	for range 40 {
		select {
		case err := <-errs:
			if !errdefs.IsResourceExhausted(err) {
				t.Fatalf("rejected run = %v, want ResourceExhausted", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("a run over the limit waited instead of failing fast")
		}
	}
	waitN(t, entered, 10)
	if l := e.Limits()["create"]; l != (FlowLimit{Limit: 10, InFlight: 10}) {
		t.Fatalf("Limits = %+v, want 10/10", l)
	}
	if got := testutil.ToFloat64(e.m.inflight.WithLabelValues("create")); got != 10 {
		t.Fatalf("inflight gauge = %v, want 10", got)
	}
	if got := testutil.ToFloat64(e.m.rejected.WithLabelValues("create")); got != 40 {
		t.Fatalf("rejected counter = %v, want 40", got)
	}
	select {
	case err := <-errs:
		t.Fatalf("an 11th run finished early: %v", err)
	default:
	}
	close(release)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("admitted run = %v", err)
		}
	}
	if l := e.Limits()["create"]; l.InFlight != 0 {
		t.Fatalf("InFlight after all runs = %d", l.InFlight)
	}
}

func TestSetLimit(t *testing.T) {
	entered := make(chan struct{}, 10)
	release := make(chan struct{})
	e := newEngine(t, newRegistry(t, nil, gate("block", entered, release)),
		Config{"create": {Limit: 1, Steps: [][]string{{"block"}}}})
	ctx := context.Background()
	var wg sync.WaitGroup
	start := func() {
		wg.Go(func() {
			if _, err := e.Run(ctx, "create", &task{}); err != nil {
				t.Errorf("Run: %v", err)
			}
		})
	}
	start()
	waitN(t, entered, 1)
	if _, err := e.Run(ctx, "create", &task{}); !errdefs.IsResourceExhausted(err) {
		t.Fatalf("second run at limit 1 = %v", err)
	}
	if err := e.SetLimit("create", 2); err != nil {
		t.Fatal(err)
	}
	start()
	waitN(t, entered, 1)
	if err := e.SetLimit("create", 1); err != nil { // below in-flight: rejects, cancels nothing
		t.Fatal(err)
	}
	if l := e.Limits()["create"]; l != (FlowLimit{Limit: 1, InFlight: 2}) {
		t.Fatalf("Limits = %+v", l)
	}
	if _, err := e.Run(ctx, "create", &task{}); !errdefs.IsResourceExhausted(err) {
		t.Fatalf("run over lowered limit = %v", err)
	}
	if err := e.SetLimit("create", 0); err != nil { // unlimited
		t.Fatal(err)
	}
	start()
	waitN(t, entered, 1)
	close(release)
	wg.Wait()

	if err := e.SetLimit("nope", 1); !errdefs.IsNotFound(err) {
		t.Fatalf("SetLimit(unknown) = %v", err)
	}
	if err := e.SetLimit("create", -1); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("SetLimit(-1) = %v", err)
	}
}

// TestReload: a run in flight keeps its step list and its limiter slot;
// runs started after Reload see the new steps and limit; a bad config
// changes nothing.
func TestReload(t *testing.T) {
	entered := make(chan struct{}, 10)
	release := make(chan struct{})
	reg := newRegistry(t, []string{"old", "new"}, gate("block", entered, release))
	e := newEngine(t, reg, Config{"create": {Limit: 1, Steps: [][]string{{"block"}, {"old"}}}})
	ctx := context.Background()

	inflight := &task{}
	done := make(chan error, 1)
	go func() {
		_, err := e.Run(ctx, "create", inflight)
		done <- err
	}()
	waitN(t, entered, 1)

	bad := Config{"create": {Limit: 5, Steps: [][]string{{"block"}, {"newx"}}}}
	if err := e.Reload(bad); err == nil {
		t.Fatal("Reload accepted an unknown action")
	}
	if got := e.Steps("create"); got[1][0] != "old" || e.Limits()["create"].Limit != 1 {
		t.Fatalf("failed Reload changed the config: %v %+v", got, e.Limits())
	}

	if err := e.Reload(Config{
		"create":  {Limit: 2, Steps: [][]string{{"block"}, {"new"}}},
		"destroy": {Steps: [][]string{{"new"}}},
	}); err != nil {
		t.Fatal(err)
	}
	if l := e.Limits()["create"]; l != (FlowLimit{Limit: 2, InFlight: 1}) {
		t.Fatalf("Limits after Reload = %+v, want limit 2 with the old run still counted", l)
	}
	if !slices.Equal(e.Flows(), []string{"create", "destroy"}) {
		t.Fatalf("Flows = %v", e.Flows())
	}

	after := &task{}
	go func() {
		_, err := e.Run(ctx, "create", after)
		done <- err
	}()
	waitN(t, entered, 1)
	if _, err := e.Run(ctx, "create", &task{}); !errdefs.IsResourceExhausted(err) {
		t.Fatalf("third run at new limit 2 = %v", err)
	}
	close(release)
	for range 2 {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	if got := inflight.doSet(); !slices.Equal(got, []string{"block", "old"}) {
		t.Fatalf("in-flight run ran %v, want its snapshot [block old]", got)
	}
	if got := after.doSet(); !slices.Equal(got, []string{"block", "new"}) {
		t.Fatalf("run after Reload ran %v, want [block new]", got)
	}

	if err := e.Reload(Config{"destroy": {Steps: [][]string{{"new"}}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Run(ctx, "create", &task{}); !errdefs.IsNotFound(err) {
		t.Fatalf("Run of a flow removed by Reload = %v", err)
	}
}

// TestConcurrentReload runs flows while limits and configs change under
// them; -race checks the engine's synchronisation.
func TestConcurrentReload(t *testing.T) {
	reg := newRegistry(t, []string{"a", "b", "c"})
	cfgs := []Config{
		{"create": {Limit: 3, Steps: [][]string{{"a", "b"}, {"c"}}}},
		{"create": {Limit: 0, Steps: [][]string{{"c"}, {"a", "b"}}}},
	}
	e := newEngine(t, reg, cfgs[0])
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for ctx.Err() == nil {
				_, err := e.Run(context.Background(), "create", &task{})
				if err != nil && !errors.Is(err, errdefs.ErrResourceExhausted) {
					t.Errorf("Run: %v", err)
					return
				}
			}
		})
	}
	for i := 0; ctx.Err() == nil; i++ {
		if err := e.Reload(cfgs[i%2]); err != nil {
			t.Fatal(err)
		}
		_ = e.SetLimit("create", i%4)
		_ = e.Limits()
		_ = e.Steps("create")
	}
	wg.Wait()
	if l := e.Limits()["create"]; l.InFlight != 0 {
		t.Fatalf("InFlight = %d after all runs", l.InFlight)
	}
}

// TestLimiterQueue: with queue set, a run over the limit waits for a slot
// and runs once one frees; one that finds none within the queue time
// fails with ResourceExhausted, after about that time. Control: the same
// run without a queue fails at once.
func TestLimiterQueue(t *testing.T) {
	entered := make(chan struct{}, 4)
	release := make(chan struct{})
	cfg := func(q time.Duration) Config {
		c := Config{"create": {Limit: 1, Steps: [][]string{{"block"}}}}
		fc := c["create"]
		fc.Queue.Duration = q
		c["create"] = fc
		return c
	}
	e := newEngine(t, newRegistry(t, nil, gate("block", entered, release)), cfg(300*time.Millisecond))
	ctx := context.Background()
	first := make(chan error, 1)
	go func() { _, err := e.Run(ctx, "create", &task{}); first <- err }()
	waitN(t, entered, 1)

	start := time.Now()
	if _, err := e.Run(ctx, "create", &task{}); !errdefs.IsResourceExhausted(err) {
		t.Fatalf("run with no slot freeing = %v, want ResourceExhausted", err)
	}
	if d := time.Since(start); d < 250*time.Millisecond {
		t.Fatalf("gave up after %s, before its queue time", d)
	}

	queued := make(chan error, 1)
	go func() { _, err := e.Run(ctx, "create", &task{}); queued <- err }()
	time.Sleep(50 * time.Millisecond)
	release <- struct{}{} // the first run finishes: its slot goes to the queued one
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	waitN(t, entered, 1)
	release <- struct{}{}
	if err := <-queued; err != nil {
		t.Fatalf("queued run = %v, want it to run once the slot freed", err)
	}

	// Control: no queue, the run over the limit fails at once.
	if err := e.Reload(cfg(0)); err != nil {
		t.Fatal(err)
	}
	go func() { _, err := e.Run(ctx, "create", &task{}); first <- err }()
	waitN(t, entered, 1)
	start = time.Now()
	if _, err := e.Run(ctx, "create", &task{}); !errdefs.IsResourceExhausted(err) || time.Since(start) > 50*time.Millisecond {
		t.Fatalf("without a queue: %v after %s, want ResourceExhausted at once", err, time.Since(start))
	}
	close(release)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
}
