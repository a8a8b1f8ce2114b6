package workflow

import (
	"context"
	"errors"
	"fmt"
	"testing"
)

// TestErrorWrap: a failed flow's error passes through the wrap (after the
// undo ran), a successful flow never calls it.
func TestErrorWrap(t *testing.T) {
	errKind := errors.New("classified")
	calls := 0
	wrap := WithErrorWrap(func(err error) error {
		calls++
		return fmt.Errorf("%w: %w", err, errKind)
	})
	fail := &fake{name: "b", create: func(context.Context, *task) error { return errBoom }}
	e := newEngine(t, newRegistry(t, []string{"a", "b"}, fail), Config{"create": {Steps: [][]string{{"a"}, {"b"}}}}, wrap)
	tk := &task{}
	_, err := e.Run(context.Background(), "create", tk)
	if !errors.Is(err, errBoom) || !errors.Is(err, errKind) || calls != 1 {
		t.Fatalf("failed flow: %v (wrap called %d times)", err, calls)
	}
	if len(tk.undos) != 2 {
		t.Fatalf("undos %v", tk.undos)
	}
	ok := newEngine(t, newRegistry(t, []string{"a"}), Config{"create": {Steps: [][]string{{"a"}}}}, wrap)
	if _, err := ok.Run(context.Background(), "create", &task{}); err != nil || calls != 1 {
		t.Fatalf("successful flow: %v (wrap called %d times)", err, calls)
	}
}
