package workflow

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
)

// task is the test T: it records what happened, in order.
type task struct {
	mu    sync.Mutex
	dos   []string
	undos []string
	undoC []error // ctx.Err() seen by each undo
}

func (t *task) did(name string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.dos = append(t.dos, name)
}

func (t *task) undid(ctx context.Context, name string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.undos = append(t.undos, name)
	t.undoC = append(t.undoC, ctx.Err())
}

func (t *task) doSet() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := slices.Clone(t.dos)
	slices.Sort(s)
	return s
}

// Capabilities, as cubelet declares them.
type (
	creator interface {
		Create(context.Context, *task) error
	}
	undoer interface {
		UndoCreate(context.Context, *task) error
	}
	destroyer interface {
		Destroy(context.Context, *task) error
	}
	initer interface{ Init(context.Context) error }
)

// fake implements every capability; func fields override the default
// behaviour (record and succeed).
type fake struct {
	name    string
	create  func(context.Context, *task) error
	undo    func(context.Context, *task) error
	destroy func(context.Context, *task) error
	init    func(context.Context) error
}

var (
	_ creator   = (*fake)(nil)
	_ undoer    = (*fake)(nil)
	_ destroyer = (*fake)(nil)
	_ initer    = (*fake)(nil)
)

func (f *fake) Name() string { return f.name }

func (f *fake) Create(ctx context.Context, t *task) error {
	t.did(f.name)
	if f.create != nil {
		return f.create(ctx, t)
	}
	return nil
}

func (f *fake) UndoCreate(ctx context.Context, t *task) error {
	t.undid(ctx, f.name)
	if f.undo != nil {
		return f.undo(ctx, t)
	}
	return nil
}

func (f *fake) Destroy(ctx context.Context, t *task) error {
	t.did(f.name)
	if f.destroy != nil {
		return f.destroy(ctx, t)
	}
	return nil
}

func (f *fake) Init(ctx context.Context) error {
	if f.init != nil {
		return f.init(ctx)
	}
	return nil
}

// createOnly supports create and nothing else.
type createOnly struct{ name string }

func (c createOnly) Name() string                            { return c.name }
func (c createOnly) Create(context.Context, *task) error     { return nil }
func (c createOnly) UndoCreate(context.Context, *task) error { return nil }

var errBoom = errors.New("boom")

func testVerbs() []Verb[*task] {
	return []Verb[*task]{
		{
			Name: "create", Mode: Forward, Supports: Implements[creator],
			Call: func(ctx context.Context, a Action, t *task) error { return a.(creator).Create(ctx, t) },
			Undo: func(ctx context.Context, a Action, t *task) error {
				if u, ok := a.(undoer); ok {
					return u.UndoCreate(ctx, t)
				}
				return nil
			},
		},
		{
			Name: "destroy", Mode: Teardown, Supports: Implements[destroyer],
			Call: func(ctx context.Context, a Action, t *task) error { return a.(destroyer).Destroy(ctx, t) },
		},
		{
			Name: "init", Mode: Init, Supports: Implements[initer],
			Call: func(ctx context.Context, a Action, _ *task) error { return a.(initer).Init(ctx) },
		},
	}
}

// newRegistry registers a fake per name, with overrides from custom.
func newRegistry(t *testing.T, names []string, custom ...Action) *Registry {
	t.Helper()
	reg := NewRegistry()
	for _, a := range custom {
		reg.MustRegister(a)
	}
	for _, n := range names {
		if _, ok := reg.Lookup(n); !ok {
			reg.MustRegister(&fake{name: n})
		}
	}
	return reg
}

func newEngine(t *testing.T, reg *Registry, cfg Config, opts ...Option) *Engine[*task] {
	t.Helper()
	e, err := New(reg, testVerbs(), cfg, opts...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return e
}
