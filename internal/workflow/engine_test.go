package workflow

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pelletier/go-toml/v2"

	"github.com/cubesandbox/cube/internal/errdefs"
)

const exampleTOML = `
[flows.init]
steps = [["store.open"], ["net.pool", "disk.pool"]]

[flows.create]
limit = 10
steps = [["disk.clone", "net.slot"], ["disk.mount"], ["runtime.start"], ["agent.wait"]]

[flows.destroy]
steps = [["agent.wait"], ["runtime.start"], ["disk.mount", "net.slot"]]
`

var exampleActions = []string{"store.open", "net.pool", "disk.pool", "disk.clone", "net.slot", "disk.mount", "runtime.start", "agent.wait"}

func TestConfigTOML(t *testing.T) {
	var daemon struct {
		Flows Config `toml:"flows"`
	}
	if err := toml.Unmarshal([]byte(exampleTOML), &daemon); err != nil {
		t.Fatal(err)
	}
	e := newEngine(t, newRegistry(t, exampleActions), daemon.Flows)
	if got := e.Flows(); !slices.Equal(got, []string{"create", "destroy", "init"}) {
		t.Fatalf("Flows() = %v", got)
	}
	want := [][]string{{"disk.clone", "net.slot"}, {"disk.mount"}, {"runtime.start"}, {"agent.wait"}}
	got := e.Steps("create")
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("Steps(create) = %v, want %v", got, want)
	}
	got[0][0] = "mutated"
	if e.Steps("create")[0][0] != "disk.clone" {
		t.Fatal("Steps returned the engine's own slices")
	}
	if e.Steps("nope") != nil {
		t.Fatal("Steps of unknown flow is not nil")
	}
	if l := e.Limits()["create"]; l.Limit != 10 || l.InFlight != 0 {
		t.Fatalf("Limits()[create] = %+v", l)
	}
}

func TestNewValidation(t *testing.T) {
	names := []string{"a", "b", "c"}
	tests := []struct {
		name  string
		cfg   Config
		verbs []Verb[*task]
		want  string
	}{
		{"unknown action", Config{"create": {Steps: [][]string{{"a"}, {"disk.clon"}}}}, nil,
			`workflow: flow "create" step 2: unknown action "disk.clon"`},
		{"flow without verb", Config{"snapshot": {Steps: [][]string{{"a"}}}}, nil,
			`workflow: flow "snapshot": no verb of that name`},
		{"capability missing", Config{"destroy": {Steps: [][]string{{"a"}, {"only"}}}}, nil,
			`workflow: flow "destroy" step 2: action "only" (workflow.createOnly) does not support verb "destroy"`},
		{"no steps", Config{"create": {}}, nil, `workflow: flow "create": no steps`},
		{"empty step", Config{"create": {Steps: [][]string{{"a"}, {}}}}, nil, `workflow: flow "create" step 2: empty step`},
		{"duplicate in step", Config{"create": {Steps: [][]string{{"a", "a"}}}}, nil,
			`workflow: flow "create" step 1: duplicate action "a" (already in step 1)`},
		{"duplicate across steps", Config{"create": {Steps: [][]string{{"a"}, {"b"}, {"a"}}}}, nil,
			`workflow: flow "create" step 3: duplicate action "a" (already in step 1)`},
		{"negative limit", Config{"create": {Limit: -1, Steps: [][]string{{"a"}}}}, nil, `negative limit -1`},
		{"verb without call", nil, []Verb[*task]{{Name: "x", Mode: Forward}}, `verb "x": nil Call`},
		{"verb without name", nil, []Verb[*task]{{Mode: Forward}}, `empty name`},
		{"verb bad mode", nil, []Verb[*task]{{Name: "x", Call: testVerbs()[0].Call}}, `invalid mode Mode(0)`},
		{"undo on teardown", nil, []Verb[*task]{{Name: "x", Mode: Teardown, Call: testVerbs()[0].Call, Undo: testVerbs()[0].Undo}},
			`Undo is only allowed on Forward verbs`},
		{"duplicate verb", nil, append(testVerbs(), testVerbs()[0]), `duplicate verb "create"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			verbs := tt.verbs
			if verbs == nil {
				verbs = testVerbs()
			}
			_, err := New(newRegistry(t, names, createOnly{"only"}), verbs, tt.cfg)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("New error = %v, want it to contain %q", err, tt.want)
			}
			if !errdefs.IsInvalidArgument(err) {
				t.Fatalf("New error %v does not wrap ErrInvalidArgument", err)
			}
		})
	}
	if _, err := New[*task](nil, testVerbs(), nil); err == nil {
		t.Fatal("New with nil registry succeeded")
	}
}

func TestRegistry(t *testing.T) {
	reg := NewRegistry()
	if err := reg.Register(&fake{name: "a"}); err != nil {
		t.Fatal(err)
	}
	if err := reg.Register(&fake{name: "a"}); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("duplicate Register = %v, want AlreadyExists", err)
	}
	if err := reg.Register(nil); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("Register(nil) = %v", err)
	}
	if err := reg.Register(&fake{}); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("Register(empty name) = %v", err)
	}
	if got := reg.Names(); !slices.Equal(got, []string{"a"}) {
		t.Fatalf("Names() = %v", got)
	}
	defer func() {
		if recover() == nil {
			t.Fatal("MustRegister of a duplicate did not panic")
		}
	}()
	reg.MustRegister(&fake{name: "a"})
}

func TestRunUnknownFlow(t *testing.T) {
	e := newEngine(t, newRegistry(t, []string{"a"}), Config{"create": {Steps: [][]string{{"a"}}}})
	// "destroy" has a verb but no flow: also not found.
	for _, flow := range []string{"nope", "destroy"} {
		if _, err := e.Run(context.Background(), flow, &task{}); !errdefs.IsNotFound(err) {
			t.Fatalf("Run(%q) = %v, want NotFound", flow, err)
		}
	}
}

// TestParallelWithinStep checks that the actions of one step overlap: each
// waits until all three are running at once, and the step does not finish
// before the slowest one.
func TestParallelWithinStep(t *testing.T) {
	var running, maxRunning atomic.Int32
	all := make(chan struct{})
	var entered atomic.Int32
	barrier := func(ctx context.Context, _ *task) error {
		n := running.Add(1)
		defer running.Add(-1)
		for {
			m := maxRunning.Load()
			if n <= m || maxRunning.CompareAndSwap(m, n) {
				break
			}
		}
		if entered.Add(1) == 3 {
			close(all)
		}
		select {
		case <-all:
			time.Sleep(20 * time.Millisecond)
			return nil
		case <-time.After(5 * time.Second):
			return errors.New("actions of a step did not run in parallel")
		}
	}
	reg := newRegistry(t, []string{"d"}, &fake{name: "a", create: barrier}, &fake{name: "b", create: barrier}, &fake{name: "c", create: barrier})
	e := newEngine(t, reg, Config{"create": {Steps: [][]string{{"a", "b", "c"}, {"d"}}}})
	res, err := e.Run(context.Background(), "create", &task{})
	if err != nil {
		t.Fatal(err)
	}
	if m := maxRunning.Load(); m != 3 {
		t.Fatalf("max overlap = %d, want 3", m)
	}
	// Timings: step order, declaration order within the step.
	var order []string
	for _, tm := range res.Timings {
		order = append(order, fmt.Sprintf("%d:%s:%s", tm.Step, tm.Action, tm.Phase))
		if tm.Duration <= 0 && tm.Action != "d" {
			t.Errorf("timing %+v has no duration", tm)
		}
	}
	if got := strings.Join(order, " "); got != "1:a:do 1:b:do 1:c:do 2:d:do" {
		t.Fatalf("timings = %s", got)
	}
	if res.Flow != "create" || res.Duration < 20*time.Millisecond {
		t.Fatalf("result = %+v", res)
	}
}

// TestForwardUndo checks stop-at-first-failing-step and the exact reverse
// undo order, including the undo of the failed actions themselves.
func TestForwardUndo(t *testing.T) {
	steps := [][]string{{"a", "b"}, {"c"}, {"d", "e"}, {"f"}}
	all := []string{"a", "b", "c", "d", "e", "f"}
	tests := []struct {
		name      string
		fail      []string // actions whose Create fails
		wantDos   []string // sorted
		wantUndos []string // exact order
	}{
		{"success", nil, all, nil},
		{"first step second action", []string{"b"}, []string{"a", "b"}, []string{"b", "a"}},
		{"first step first action", []string{"a"}, []string{"a", "b"}, []string{"b", "a"}},
		{"middle step", []string{"d"}, []string{"a", "b", "c", "d", "e"}, []string{"e", "d", "c", "b", "a"}},
		{"both in a step", []string{"d", "e"}, []string{"a", "b", "c", "d", "e"}, []string{"e", "d", "c", "b", "a"}},
		{"last step", []string{"f"}, all, []string{"f", "e", "d", "c", "b", "a"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var custom []Action
			for _, n := range tt.fail {
				custom = append(custom, &fake{name: n, create: func(context.Context, *task) error {
					return fmt.Errorf("%s: %w", n, errBoom)
				}})
			}
			e := newEngine(t, newRegistry(t, all, custom...), Config{"create": {Steps: steps}})
			tk := &task{}
			res, err := e.Run(context.Background(), "create", tk)
			if (err != nil) != (tt.fail != nil) {
				t.Fatalf("Run error = %v", err)
			}
			if err != nil {
				if !errors.Is(err, errBoom) || errors.Is(err, ErrUndoIncomplete) {
					t.Fatalf("Run error = %v, want errBoom without ErrUndoIncomplete", err)
				}
				for _, n := range tt.fail {
					if !strings.Contains(err.Error(), fmt.Sprintf("action %q: %s: boom", n, n)) {
						t.Errorf("error %q does not name failed action %q", err, n)
					}
				}
			}
			if got := tk.doSet(); !slices.Equal(got, tt.wantDos) {
				t.Errorf("dos = %v, want %v", got, tt.wantDos)
			}
			if !slices.Equal(tk.undos, tt.wantUndos) {
				t.Errorf("undos = %v, want %v", tk.undos, tt.wantUndos)
			}
			var undoTimings []string
			for _, tm := range res.Timings {
				if tm.Phase == PhaseUndo {
					undoTimings = append(undoTimings, tm.Action)
				} else if slices.Contains(tt.fail, tm.Action) != (tm.Err != "") {
					t.Errorf("timing %+v: Err does not match failure", tm)
				}
			}
			if !slices.Equal(undoTimings, tt.wantUndos) {
				t.Errorf("undo timings = %v, want %v", undoTimings, tt.wantUndos)
			}
		})
	}
}

func TestUndoFailuresJoined(t *testing.T) {
	errUndo := errors.New("undo broke")
	reg := newRegistry(t, []string{"b", "d"},
		&fake{name: "a", undo: func(context.Context, *task) error { return errUndo }},
		&fake{name: "c", undo: func(context.Context, *task) error { panic("undo panic") }},
		&fake{name: "e", create: func(context.Context, *task) error { return errBoom }},
	)
	e := newEngine(t, reg, Config{"create": {Steps: [][]string{{"a", "b"}, {"c"}, {"d", "e"}}}})
	tk := &task{}
	_, err := e.Run(context.Background(), "create", tk)
	if !errors.Is(err, errBoom) || !errors.Is(err, ErrUndoIncomplete) || !errors.Is(err, errUndo) {
		t.Fatalf("Run error = %v, want errBoom, ErrUndoIncomplete and errUndo", err)
	}
	for _, s := range []string{`step 1 action "a": undo: undo broke`, `step 2 action "c": undo: panic: undo panic`} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("error %q does not mention %q", err, s)
		}
	}
	if want := []string{"e", "d", "c", "b", "a"}; !slices.Equal(tk.undos, want) {
		t.Fatalf("undos = %v, want all of %v despite failures", tk.undos, want)
	}
}

// TestUndoIgnoresCancel: the caller's ctx is cancelled mid-flow; the flow
// stops and undo still runs with a live context.
func TestUndoIgnoresCancel(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	reg := newRegistry(t, []string{"a", "c"}, &fake{name: "b", create: func(context.Context, *task) error {
		cancel()
		return nil
	}})
	e := newEngine(t, reg, Config{"create": {Steps: [][]string{{"a"}, {"b"}, {"c"}}}})
	tk := &task{}
	_, err := e.Run(ctx, "create", tk)
	if !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "step 3: not started") {
		t.Fatalf("Run error = %v, want step 3 not started: canceled", err)
	}
	if !slices.Equal(tk.undos, []string{"b", "a"}) {
		t.Fatalf("undos = %v, want [b a]", tk.undos)
	}
	for i, e := range tk.undoC {
		if e != nil {
			t.Errorf("undo %d saw ctx error %v", i, e)
		}
	}
}

// TestUndoBounded: the undo outlives the caller's cancel but not its own
// bound. An undo that hangs on its context ends when the bound passes, and
// the run reports the undo incomplete instead of hanging with it.
func TestUndoBounded(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var deadline time.Time
	reg := newRegistry(t, nil,
		&fake{name: "a", undo: func(ctx context.Context, _ *task) error {
			deadline, _ = ctx.Deadline()
			<-ctx.Done() // a runtime that never answers
			return ctx.Err()
		}},
		&fake{name: "b", create: func(context.Context, *task) error {
			cancel()
			return errBoom
		}})
	e := newEngine(t, reg, Config{"create": {Steps: [][]string{{"a"}, {"b"}}}}, WithUndoBound(200*time.Millisecond))
	start := time.Now()
	_, err := e.Run(ctx, "create", &task{})
	took := time.Since(start)
	if !errors.Is(err, ErrUndoIncomplete) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Run error = %v, want the undo incomplete on its own deadline", err)
	}
	if deadline.IsZero() || took < 200*time.Millisecond || took > 5*time.Second {
		t.Fatalf("undo deadline %v, run took %s; want a bounded undo of about 200ms", deadline, took)
	}
	t.Logf("hanging undo ended by its bound after %s: %v", took, err)
}

func TestTeardownRunsAll(t *testing.T) {
	errX, errY := errors.New("x failed"), errors.New("y failed")
	reg := newRegistry(t, []string{"b", "c", "d"},
		&fake{name: "a", destroy: func(context.Context, *task) error { return errX }},
		&fake{name: "e", destroy: func(context.Context, *task) error { panic("eek") }},
		&fake{name: "f", destroy: func(context.Context, *task) error { return errY }},
	)
	e := newEngine(t, reg, Config{"destroy": {Steps: [][]string{{"a", "b"}, {"c"}, {"d", "e", "f"}}}})
	tk := &task{}
	res, err := e.Run(context.Background(), "destroy", tk)
	if !errors.Is(err, errX) || !errors.Is(err, errY) || !strings.Contains(err.Error(), `action "e": panic: eek`) {
		t.Fatalf("Run error = %v, want x, y and the panic", err)
	}
	if got := tk.doSet(); !slices.Equal(got, []string{"a", "b", "c", "d", "e", "f"}) {
		t.Fatalf("teardown ran %v, want every action", got)
	}
	if len(tk.undos) != 0 || len(res.Timings) != 6 {
		t.Fatalf("undos = %v, timings = %d", tk.undos, len(res.Timings))
	}
}

func TestInitModeNoUndo(t *testing.T) {
	var ran []string
	reg := newRegistry(t, nil,
		&fake{name: "a", init: func(context.Context) error { ran = append(ran, "a"); return nil }},
		&fake{name: "b", init: func(context.Context) error { return errBoom }},
		&fake{name: "c", init: func(context.Context) error { ran = append(ran, "c"); return nil }},
	)
	e := newEngine(t, reg, Config{"init": {Steps: [][]string{{"a"}, {"b"}, {"c"}}}})
	var zero *task // Init runs without a task
	res, err := e.Run(context.Background(), "init", zero)
	if !errors.Is(err, errBoom) {
		t.Fatalf("Run = %v", err)
	}
	if !slices.Equal(ran, []string{"a"}) {
		t.Fatalf("ran %v, want [a] (stop at first failing step)", ran)
	}
	for _, tm := range res.Timings {
		if tm.Phase == PhaseUndo {
			t.Fatalf("Init mode undid %+v", tm)
		}
	}
}

func TestPanicRecovered(t *testing.T) {
	reg := newRegistry(t, []string{"a"}, &fake{name: "p", create: func(context.Context, *task) error { panic("kaboom") }})
	e := newEngine(t, reg, Config{"create": {Steps: [][]string{{"a"}, {"p"}}}})
	tk := &task{}
	_, err := e.Run(context.Background(), "create", tk)
	if err == nil || !strings.Contains(err.Error(), `step 2 action "p": panic: kaboom`) {
		t.Fatalf("Run = %v, want the panic as an error naming the action", err)
	}
	if !slices.Equal(tk.undos, []string{"p", "a"}) {
		t.Fatalf("undos = %v, want [p a]", tk.undos)
	}
}
