// Package health turns a node's probe results into conditions that fail
// only when the failure persists: one failed probe (a runtime busy with a
// burst of creates, a slow disk for a moment) makes the node busy, never
// unhealthy. A condition fails once it has failed Threshold probes in a
// row; one success clears it.
package health

import (
	"sort"
	"sync"
)

// Condition is one check after the window.
type Condition struct {
	Type string
	// OK is false only when the check failed Threshold times in a row.
	OK bool
	// Flapping: the last probe failed but the failure is not yet
	// persistent (OK is still true).
	Flapping bool
	// Message is the last failure's text while the check fails or flaps.
	Message string
	// Failures is how many probes in a row failed.
	Failures int
}

// Tracker keeps each condition's run of failures.
type Tracker struct {
	threshold int
	mu        sync.Mutex
	fails     map[string]int
	conds     []Condition
}

// New returns a Tracker that fails a condition after threshold failed
// probes in a row (at least 1).
func New(threshold int) *Tracker {
	return &Tracker{threshold: max(threshold, 1), fails: map[string]int{}}
}

// Observe records one round of probes (condition type → error, nil for a
// pass) and returns the conditions, sorted by type. A condition absent
// from the round is forgotten.
func (t *Tracker) Observe(round map[string]error) []Condition {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]Condition, 0, len(round))
	seen := map[string]bool{}
	for typ, err := range round {
		seen[typ] = true
		c := Condition{Type: typ, OK: true}
		if err == nil {
			t.fails[typ] = 0
		} else {
			t.fails[typ]++
			c.Failures, c.Message = t.fails[typ], err.Error()
			c.OK = c.Failures < t.threshold
			c.Flapping = c.OK
		}
		out = append(out, c)
	}
	for typ := range t.fails {
		if !seen[typ] {
			delete(t.fails, typ)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Type < out[j].Type })
	t.conds = out
	return out
}

// Last returns the conditions of the last round.
func (t *Tracker) Last() []Condition {
	t.mu.Lock()
	defer t.mu.Unlock()
	return append([]Condition(nil), t.conds...)
}

// Summary folds conditions: ok is false when any fails; busy lists the
// flapping ones ("type: message").
func Summary(conds []Condition) (ok bool, flapping []string) {
	ok = true
	for _, c := range conds {
		ok = ok && c.OK
		if c.Flapping {
			flapping = append(flapping, c.Type+": "+c.Message)
		}
	}
	return ok, flapping
}
