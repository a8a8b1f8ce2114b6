package audit

import (
	"slices"
	"time"
	"unicode/utf8"
)

// Notable verdicts (a denied or failed connection or query, a cut
// connection) wait in the log for the control plane to take them
// (TakeNotable: cubelet forwards them to the master with its heartbeat,
// where they become the sandbox's events). They are bounded twice, so a
// sandbox hammering a denied name neither floods the master nor grows
// the agent: each sandbox gets NotableBurst of them per NotableWindow and
// the rest are only counted, and at most MaxNotable wait in all (the
// oldest go first, counted as dropped). The JSONL file keeps every
// event.
const (
	NotableBurst  = 10
	NotableWindow = time.Minute
	MaxNotable    = 1024
	// MaxNotableField bounds a queued event's Name, Rule and Reason (a
	// name is what the sandbox claimed, an HTTP Host up to the proxy's
	// head limit): longer ones are cut, marked with "…".
	MaxNotableField = 256
)

// Truncate cuts s to at most n bytes (on a UTF-8 boundary), ending it
// with "…" when it cut.
func Truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	const mark = "…"
	cut := max(n-len(mark), 0)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + mark
}

// Notable is what TakeNotable returns: the events, and per sandbox how
// many notable events the limits left out since the last take.
type Notable struct {
	Events     []Event
	Suppressed map[string]int
}

type notableState struct {
	events     []Event
	suppressed map[string]int
	// windows: per sandbox, the start of its current window and how many
	// events it queued in it.
	windows map[string]*notableWindow
}

type notableWindow struct {
	start time.Time
	n     int
}

// isNotable: the verdicts the control plane hears about.
func isNotable(e Event) bool { return e.Verdict == Denied || e.Verdict == Failed || e.Kind == KindCut }

// queueNotable keeps e for TakeNotable when it is notable and within the
// limits. l.mu is held.
func (l *Log) queueNotable(e Event) {
	if !isNotable(e) {
		return
	}
	s := &l.notable
	if s.windows == nil {
		s.windows = map[string]*notableWindow{}
		s.suppressed = map[string]int{}
	}
	w := s.windows[e.SandboxID]
	if w == nil || e.Time.Sub(w.start) >= NotableWindow {
		if len(s.windows) >= MaxNotable {
			// Old windows of sandboxes that went quiet.
			for id, ow := range s.windows {
				if e.Time.Sub(ow.start) >= NotableWindow {
					delete(s.windows, id)
				}
			}
		}
		w = &notableWindow{start: e.Time}
		s.windows[e.SandboxID] = w
	}
	if w.n >= NotableBurst {
		s.suppressed[e.SandboxID]++
		return
	}
	w.n++
	e.Name, e.Rule, e.Reason = Truncate(e.Name, MaxNotableField), Truncate(e.Rule, MaxNotableField), Truncate(e.Reason, MaxNotableField)
	if len(s.events) >= MaxNotable {
		s.suppressed[s.events[0].SandboxID]++
		s.events = slices.Delete(s.events, 0, 1)
	}
	s.events = append(s.events, e)
}

// TakeNotable returns the notable events queued since the last take and
// forgets them (nil *Log: none).
func (l *Log) TakeNotable() Notable {
	if l == nil {
		return Notable{}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	out := Notable{Events: l.notable.events, Suppressed: l.notable.suppressed}
	l.notable.events, l.notable.suppressed = nil, map[string]int{}
	return out
}
