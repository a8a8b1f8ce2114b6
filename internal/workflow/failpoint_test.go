package workflow

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/failpoint"
)

// TestFailpointsDriveUndo discovers every failpoint the create flow
// evaluates, fires each in turn, and checks the rollback contract: the run
// fails with the injected error, and every action that started is undone in
// reverse (the "after" points fire once the action did its work, so its own
// undo must run too).
func TestFailpointsDriveUndo(t *testing.T) {
	t.Cleanup(failpoint.Reset)
	steps := [][]string{{"a", "b"}, {"c"}, {"d"}}
	e := newEngine(t, newRegistry(t, []string{"a", "b", "c", "d"}), Config{"create": {Steps: steps}}, WithFailpoints(true))
	ctx := context.Background()

	failpoint.Reset()
	failpoint.Track()
	if _, err := e.Run(ctx, "create", &task{}); err != nil {
		t.Fatal(err)
	}
	names := failpoint.Names()
	want := []string{"create/a", "create/a/after", "create/b", "create/b/after", "create/c", "create/c/after", "create/d", "create/d/after"}
	if !slices.Equal(names, want) {
		t.Fatalf("evaluated failpoints = %v, want %v", names, want)
	}

	undoOrder := map[string][]string{ // by the action whose point fires
		"a": {"b", "a"}, "b": {"b", "a"}, "c": {"c", "b", "a"}, "d": {"d", "c", "b", "a"},
	}
	for _, name := range names {
		t.Run(name, func(t *testing.T) {
			failpoint.Reset()
			if err := failpoint.Enable(name, "error"); err != nil {
				t.Fatal(err)
			}
			action, after := strings.CutSuffix(strings.TrimPrefix(name, "create/"), "/after")
			tk := &task{}
			_, err := e.Run(ctx, "create", tk)
			if !errors.Is(err, failpoint.ErrInjected) || !strings.Contains(err.Error(), `action "`+action+`"`) {
				t.Fatalf("Run = %v, want injected error at %q", err, action)
			}
			if did := slices.Contains(tk.doSet(), action); did != after {
				t.Fatalf("action %s did its work = %v, want %v", action, did, after)
			}
			if !slices.Equal(tk.undos, undoOrder[action]) {
				t.Fatalf("undos = %v, want %v", tk.undos, undoOrder[action])
			}
		})
	}
}

func TestFailpointUndoAndPanic(t *testing.T) {
	t.Cleanup(failpoint.Reset)
	e := newEngine(t, newRegistry(t, []string{"a", "b"}), Config{"create": {Steps: [][]string{{"a"}, {"b"}}}}, WithFailpoints(true))
	failpoint.Reset()
	for name, spec := range map[string]string{"create/b": "panic(fp)", "create/a/undo": "error(stuck)"} {
		if err := failpoint.Enable(name, spec); err != nil {
			t.Fatal(err)
		}
	}
	tk := &task{}
	_, err := e.Run(context.Background(), "create", tk)
	if err == nil || !strings.Contains(err.Error(), `action "b": panic: failpoint "create/b": fp`) {
		t.Fatalf("Run = %v, want the failpoint panic recovered", err)
	}
	if !errors.Is(err, ErrUndoIncomplete) || !errors.Is(err, failpoint.ErrInjected) || !strings.Contains(err.Error(), "stuck") {
		t.Fatalf("Run = %v, want the undo failure of a", err)
	}
	if !slices.Equal(tk.undos, []string{"b"}) {
		t.Fatalf("undos = %v, want [b] (a's undo failed at its failpoint)", tk.undos)
	}
}

func TestFailpointsOffByDefault(t *testing.T) {
	t.Cleanup(failpoint.Reset)
	failpoint.Reset()
	if err := failpoint.Enable("create/a", "error"); err != nil {
		t.Fatal(err)
	}
	e := newEngine(t, newRegistry(t, []string{"a"}), Config{"create": {Steps: [][]string{{"a"}}}})
	if _, err := e.Run(context.Background(), "create", &task{}); err != nil {
		t.Fatalf("engine without WithFailpoints evaluated one: %v", err)
	}
}
