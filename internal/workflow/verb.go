package workflow

import (
	"context"
	"fmt"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// Mode says how the engine runs a verb's flow. See the package doc.
type Mode int

const (
	// Forward runs steps in order, stops at the first failing step and
	// undoes every started action in reverse.
	Forward Mode = iota + 1
	// Teardown runs every step whatever fails and joins all errors.
	Teardown
	// Init is Forward without undo; the task may be a zero value.
	Init
)

func (m Mode) String() string {
	switch m {
	case Forward:
		return "forward"
	case Teardown:
		return "teardown"
	case Init:
		return "init"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// Verb makes one action capability callable by the engine. The flow that
// runs a verb has the verb's Name.
type Verb[T any] struct {
	// Name is the verb and flow name, e.g. "create".
	Name string
	// Mode is Forward, Teardown or Init.
	Mode Mode
	// Supports reports whether an action implements this verb's capability;
	// New and Reload refuse a flow listing an action for which it is false.
	// Nil means every action is supported.
	Supports func(a Action) bool
	// Call runs the verb on one action. It is only called for actions
	// Supports accepted. It must honour ctx.
	Call func(ctx context.Context, a Action, t T) error
	// Undo reverts Call for one action (Forward only; nil = nothing to
	// undo). It is called for every started action, including the ones
	// whose Call failed or never got past a failpoint, so it must be
	// idempotent and harmless without a prior Call.
	Undo func(ctx context.Context, a Action, t T) error
}

func (v *Verb[T]) validate() error {
	bad := func(why string) error {
		return fmt.Errorf("workflow: verb %q: %s: %w", v.Name, why, errdefs.ErrInvalidArgument)
	}
	switch {
	case v.Name == "":
		return bad("empty name")
	case v.Mode != Forward && v.Mode != Teardown && v.Mode != Init:
		return bad("invalid mode " + v.Mode.String())
	case v.Call == nil:
		return bad("nil Call")
	case v.Undo != nil && v.Mode != Forward:
		return bad("Undo is only allowed on Forward verbs, mode is " + v.Mode.String())
	}
	return nil
}

func (v *Verb[T]) supports(a Action) bool {
	return v.Supports == nil || v.Supports(a)
}
