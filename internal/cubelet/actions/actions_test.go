package actions

import (
	"context"
	"errors"
	"testing"

	"github.com/cubesandbox/cube/internal/cubelet/config"
	"github.com/cubesandbox/cube/internal/workflow"
)

// TestDefaultFlows checks every flow of default.toml against the verb
// table and the registered actions, as New does at start-up.
func TestDefaultFlows(t *testing.T) {
	cfg, err := config.Parse(nil)
	if err != nil {
		t.Fatal(err)
	}
	reg := workflow.NewRegistry()
	Register(NewNode(cfg), reg)
	e, err := workflow.New(reg, Verbs(), cfg.Flows)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]bool{}
	for _, v := range Verbs() {
		want[v.Name] = true
	}
	for _, f := range e.Flows() {
		delete(want, f)
	}
	if len(want) > 0 {
		t.Errorf("verbs without a flow in default.toml: %v", want)
	}
}

func TestLedger(t *testing.T) {
	ctx := context.Background()
	var l Ledger
	var gave []Hold
	give := func(h Hold, err error) func(context.Context) error {
		return func(context.Context) error {
			if err != nil {
				return err
			}
			gave = append(gave, h)
			return nil
		}
	}
	if err := l.Release(ctx, Frozen); err != nil || len(gave) != 0 {
		t.Fatalf("release of nothing held: %v %v", err, gave)
	}
	l.Take(Quiesced, give(Quiesced, nil))
	l.Take(Frozen, give(Frozen, nil))
	if got := l.String(); got != "quiesced,frozen" {
		t.Fatalf("held %q", got)
	}
	if err := l.Release(ctx, Frozen); err != nil || !l.Holds(Quiesced) || l.Holds(Frozen) {
		t.Fatalf("release frozen: %v, held %q", err, l.String())
	}
	if err := l.Release(ctx, Frozen); err != nil || len(gave) != 1 {
		t.Fatalf("second release ran again: %v %v", err, gave)
	}
	l.Drop(Quiesced)
	if l.Holds(Quiesced) || len(gave) != 1 {
		t.Fatalf("drop: held %q, gave %v", l.String(), gave)
	}
	// A release that fails keeps the hold for a later undo.
	boom := errors.New("boom")
	l.Take(Checkpointed, give(Checkpointed, boom))
	if err := l.Release(ctx, Checkpointed); !errors.Is(err, boom) || !l.Holds(Checkpointed) {
		t.Fatalf("failed release: %v, held %q", err, l.String())
	}
	// A release may drop its own hold (and others) before it fails.
	l.Take(Swapped, func(context.Context) error { l.Drop(Swapped, Checkpointed); return boom })
	if err := l.Release(ctx, Swapped); !errors.Is(err, boom) || l.Holds(Swapped) || l.Holds(Checkpointed) {
		t.Fatalf("self-dropping release: %v, held %q", err, l.String())
	}
}
