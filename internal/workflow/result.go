package workflow

import "time"

// Phases of a Timing.
const (
	PhaseDo   = "do"
	PhaseUndo = "undo"
)

// Result reports one run: every action's do and undo with its duration, and
// the run's total duration. It is returned on success and on failure (with
// whatever ran).
type Result struct {
	Flow string
	// Timings lists do timings in step order, actions in declaration order
	// within a step, then undo timings in the order the undos ran.
	Timings  []Timing
	Duration time.Duration
}

// Timing is one action's do or undo.
type Timing struct {
	Step     int    // 1-based, as in error messages and Steps()[Step-1]
	Action   string // action name
	Phase    string // PhaseDo or PhaseUndo
	Duration time.Duration
	Err      string // "" on success
}
