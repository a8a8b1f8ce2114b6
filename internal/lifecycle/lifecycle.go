// Package lifecycle is the sandbox state machine: the one place that says
// which state may follow which.
//
//	           create ok                 pause
//	Creating ───────────► Running ◄──────────────► Paused
//	   │                 │  ▲  │        resume       │  │
//	   │ create failed   │  │  │ snapshot            │  │
//	   ▼                 │  │  ▼                     │  │
//	(removed)            │  Snapshotting ◄───────────┘  │
//	                     │        │                     │
//	                     ▼        ▼                     ▼
//	                 Destroying ──────► Destroyed (record removed)
//	                     │
//	                     └─ failed destroy: stays Destroying, journalled,
//	                        retried by the cleanup loop
//
// Failed and Unknown are reached from any live state when the runtime says
// the sandbox died (Failed) or cannot be asked (Unknown); from them only
// Destroying (or, for Unknown, the state the runtime reports once it can be
// asked again) is allowed.
package lifecycle

import (
	"fmt"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// State is a sandbox's lifecycle state.
type State string

const (
	Creating     State = "creating"
	Running      State = "running"
	Paused       State = "paused"
	Snapshotting State = "snapshotting"
	Destroying   State = "destroying"
	Destroyed    State = "destroyed"
	Failed       State = "failed"
	Unknown      State = "unknown"
)

// All lists every state in display order.
var All = []State{Creating, Running, Paused, Snapshotting, Destroying, Destroyed, Failed, Unknown}

// transitions holds every legal edge. A self-edge is never legal: pausing a
// paused sandbox is a FailedPrecondition, not a no-op, so callers learn the
// truth.
var transitions = map[State][]State{
	Creating:     {Running, Failed, Destroying},
	Running:      {Paused, Snapshotting, Destroying, Failed, Unknown},
	Paused:       {Running, Snapshotting, Destroying, Failed, Unknown},
	Snapshotting: {Running, Paused, Destroying, Failed, Unknown},
	Destroying:   {Destroyed, Failed},
	Failed:       {Destroying},
	Unknown:      {Running, Paused, Failed, Destroying},
	Destroyed:    nil,
}

// Valid reports whether s is a known state.
func (s State) Valid() bool {
	_, ok := transitions[s]
	return ok
}

// Live reports whether a sandbox in s holds runtime resources that a
// destroy must release.
func (s State) Live() bool { return s != Destroyed }

// CanTransition reports whether from → to is legal.
func CanTransition(from, to State) bool {
	for _, t := range transitions[from] {
		if t == to {
			return true
		}
	}
	return false
}

// TransitionError is returned for an illegal transition. It wraps
// errdefs.ErrFailedPrecondition and carries the current state so the API
// edge can put it into the error detail.
type TransitionError struct {
	ID   string
	From State
	To   State
	Verb string
}

func (e *TransitionError) Error() string {
	verb := e.Verb
	if verb == "" {
		verb = "move to " + string(e.To)
	}
	return fmt.Sprintf("sandbox %s is %s: cannot %s", e.ID, e.From, verb)
}

func (e *TransitionError) Unwrap() error { return errdefs.ErrFailedPrecondition }

// Check returns nil when from → to is legal and a *TransitionError
// otherwise. verb names the user's operation for the message ("pause").
func Check(id string, from, to State, verb string) error {
	if CanTransition(from, to) {
		return nil
	}
	return &TransitionError{ID: id, From: from, To: to, Verb: verb}
}
