package master

import (
	"strings"
	"testing"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
)

// TestEgressEventsBounded: a report of 5000 verdicts with 64 KiB names
// (a sandbox's Host header) becomes at most maxEgressVerdicts events with
// fields of at most maxEgressField bytes, plus one count of the rest; a
// report from a node that does not hold the sandbox becomes nothing. The
// control is a small report, kept whole.
func TestEgressEventsBounded(t *testing.T) {
	all := func(string) bool { return true }
	long := strings.Repeat("h", 64<<10)
	var vs []*masterpb.EgressVerdict
	for range 5000 {
		vs = append(vs, &masterpb.EgressVerdict{SandboxId: "sb", Kind: "connect", Verdict: "denied", Name: long, Reason: long, Rule: long, Addr: "1.2.3.4:443"})
	}
	evs := egressEvents("n1", vs, map[string]int32{"sb": 3}, all)
	if len(evs) != maxEgressVerdicts+1 {
		t.Fatalf("%d events, want %d", len(evs), maxEgressVerdicts+1)
	}
	for _, e := range evs[:maxEgressVerdicts] {
		for k, v := range e.fields {
			if len(v) > maxEgressField {
				t.Fatalf("field %s: %d bytes", k, len(v))
			}
		}
		if len(e.msg) > 4*maxEgressField {
			t.Fatalf("message of %d bytes", len(e.msg))
		}
	}
	last := evs[maxEgressVerdicts]
	if last.fields["suppressed"] != "3979" { // 5000-1024 over the cap + 3 the agent suppressed
		t.Fatalf("count event: %+v", last)
	}
	t.Logf("5000 verdicts of 64 KiB names: %d events, fields ≤ %d B, %s counted", len(evs), maxEgressField, last.fields["suppressed"])
	if got := egressEvents("n1", vs, map[string]int32{"sb": 3}, func(string) bool { return false }); len(got) != 0 {
		t.Fatalf("a node spoke for a sandbox it does not hold: %d events", len(got))
	}
	small := []*masterpb.EgressVerdict{{SandboxId: "sb", Kind: "connect", Verdict: "denied", Name: "evil.test", Reason: "name not allowed"}}
	got := egressEvents("n1", small, nil, all)
	if len(got) != 1 || got[0].fields["name"] != "evil.test" || got[0].fields["reason"] != "name not allowed" ||
		got[0].msg != "egress denied (connect) evil.test: name not allowed" {
		t.Fatalf("control: %+v", got)
	}
}
