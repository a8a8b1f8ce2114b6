package workflow

import (
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// Action is the base interface of every workflow plugin. An action also
// implements the capability interfaces of the verbs it supports; the engine
// finds them with Verb.Supports. Name must be unique in a Registry and
// stable: it is what configs, metrics and failpoints refer to.
//
// One Action value is shared by all concurrent runs: it must be safe for
// concurrent use and keep per-run state in the task, not in itself.
type Action interface {
	Name() string
}

// Implements reports whether a implements the capability interface C. It is
// the usual Verb.Supports:
//
//	Supports: workflow.Implements[Creator],
func Implements[C any](a Action) bool {
	_, ok := a.(C)
	return ok
}

// Registry holds actions by name. It is safe for concurrent use.
type Registry struct {
	mu      sync.RWMutex
	actions map[string]Action
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry {
	return &Registry{actions: map[string]Action{}}
}

// Register adds a. A nil action or empty name is errdefs.ErrInvalidArgument;
// a name already registered is errdefs.ErrAlreadyExists.
func (r *Registry) Register(a Action) error {
	if a == nil {
		return fmt.Errorf("workflow: register nil action: %w", errdefs.ErrInvalidArgument)
	}
	name := a.Name()
	if name == "" {
		return fmt.Errorf("workflow: register %T: empty name: %w", a, errdefs.ErrInvalidArgument)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if prev, ok := r.actions[name]; ok {
		return fmt.Errorf("workflow: action %q (%T) already registered by %T: %w", name, a, prev, errdefs.ErrAlreadyExists)
	}
	r.actions[name] = a
	return nil
}

// MustRegister is Register for start-up wiring: it panics on error.
func (r *Registry) MustRegister(actions ...Action) {
	for _, a := range actions {
		if err := r.Register(a); err != nil {
			panic(err)
		}
	}
}

// Lookup returns the action registered as name.
func (r *Registry) Lookup(name string) (Action, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	a, ok := r.actions[name]
	return a, ok
}

// Names returns the registered action names, sorted.
func (r *Registry) Names() []string {
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := make([]string, 0, len(r.actions))
	for n := range r.actions {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

// errNilRegistry is returned by New when reg is nil.
var errNilRegistry = errors.New("workflow: nil registry")
