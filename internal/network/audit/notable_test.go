package audit

import (
	"fmt"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// TestNotable: only denied, failed and cut events wait for the control
// plane; each sandbox gets NotableBurst a window and the rest are counted;
// a new window lets more through; the queue never holds more than
// MaxNotable (the oldest go, counted); a take empties it.
func TestNotable(t *testing.T) {
	l, err := New("", 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	l.Write(Event{Time: t0, SandboxID: "sb-a", Kind: KindConnect, Verdict: Allowed, Name: "ok.test"})
	l.Write(Event{Time: t0, SandboxID: "sb-a", Kind: KindDNS, Verdict: Allowed, Name: "ok.test"})
	for i := range NotableBurst + 3 {
		l.Write(Event{Time: t0, SandboxID: "sb-a", Kind: KindConnect, Verdict: Denied, Name: fmt.Sprint("bad", i)})
	}
	l.Write(Event{Time: t0, SandboxID: "sb-b", Kind: KindCut, Verdict: Denied})
	l.Write(Event{Time: t0, SandboxID: "sb-b", Kind: KindConnect, Verdict: Failed})
	n := l.TakeNotable()
	count := map[string]int{}
	for _, e := range n.Events {
		if e.Verdict == Allowed {
			t.Fatalf("an allowed event queued: %+v", e)
		}
		count[e.SandboxID]++
	}
	if count["sb-a"] != NotableBurst || count["sb-b"] != 2 || n.Suppressed["sb-a"] != 3 || n.Suppressed["sb-b"] != 0 {
		t.Fatalf("queued %v, suppressed %v", count, n.Suppressed)
	}
	if again := l.TakeNotable(); len(again.Events) != 0 || len(again.Suppressed) != 0 {
		t.Fatalf("a second take: %+v", again)
	}
	// The next window: sb-a is heard again.
	l.Write(Event{Time: t0.Add(NotableWindow), SandboxID: "sb-a", Kind: KindConnect, Verdict: Denied})
	if n := l.TakeNotable(); len(n.Events) != 1 {
		t.Fatalf("next window: %+v", n)
	}
	// The bound: many sandboxes, never more than MaxNotable queued.
	for i := range MaxNotable + 50 {
		l.Write(Event{Time: t0.Add(2 * NotableWindow), SandboxID: fmt.Sprintf("sb-%d", i), Kind: KindConnect, Verdict: Denied})
	}
	n = l.TakeNotable()
	dropped := 0
	for _, c := range n.Suppressed {
		dropped += c
	}
	if len(n.Events) != MaxNotable || dropped != 50 || n.Events[0].SandboxID != "sb-50" {
		t.Fatalf("bound: %d queued, %d counted as dropped, first %s", len(n.Events), dropped, n.Events[0].SandboxID)
	}
}

// TestNotableTruncates: a queued event's Name, Rule and Reason are cut to
// MaxNotableField bytes (a sandbox's Host header can be 64 KiB); the
// control is the same event allowed (not queued) and a short one, kept
// whole.
func TestNotableTruncates(t *testing.T) {
	l, err := New("", 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	long := strings.Repeat("é", 40<<10) // 80 KiB, two bytes a rune
	l.Write(Event{Time: time.Now(), SandboxID: "sb", Kind: KindConnect, Verdict: Denied, Name: long, Rule: long, Reason: long})
	l.Write(Event{Time: time.Now(), SandboxID: "sb", Kind: KindConnect, Verdict: Denied, Name: "short.test", Reason: "r"})
	n := l.TakeNotable()
	if len(n.Events) != 2 {
		t.Fatalf("queued %d", len(n.Events))
	}
	e := n.Events[0]
	for f, v := range map[string]string{"name": e.Name, "rule": e.Rule, "reason": e.Reason} {
		if len(v) > MaxNotableField || !utf8.ValidString(v) || !strings.HasSuffix(v, "…") {
			t.Fatalf("%s: %d bytes, valid %v", f, len(v), utf8.ValidString(v))
		}
	}
	if n.Events[1].Name != "short.test" || n.Events[1].Reason != "r" {
		t.Fatalf("a short event was changed: %+v", n.Events[1])
	}
	t.Logf("an 80 KiB name, rule and reason queued as %d bytes each; a short one whole", len(e.Name))
}
