package opsapi

import "testing"

// TestAuditRing: the log holds its last n entries once more were added,
// newest first, pages by seq, and filters.
func TestAuditRing(t *testing.T) {
	l := newAuditLog(5)
	all := func(auditEntry) bool { return true }
	for i := 1; i <= 3; i++ {
		l.add(auditEntry{Action: "a"})
	}
	if got := l.list(0, 10, all); len(got) != 3 || got[0].Seq != 3 || got[2].Seq != 1 {
		t.Fatalf("before it fills: %+v", got)
	}
	for i := 4; i <= 12; i++ {
		team := "x"
		if i%2 == 0 {
			team = "y"
		}
		l.add(auditEntry{Action: "a", Team: team})
	}
	got := l.list(0, 10, all)
	if len(got) != 5 || got[0].Seq != 12 || got[4].Seq != 8 {
		t.Fatalf("after 12 adds to a ring of 5: %+v, want seq 12..8", got)
	}
	if page := l.list(10, 2, all); len(page) != 2 || page[0].Seq != 9 || page[1].Seq != 8 {
		t.Fatalf("2 before seq 10: %+v", page)
	}
	if ys := l.list(0, 10, func(e auditEntry) bool { return e.Team == "y" }); len(ys) != 3 || ys[0].Seq != 12 || ys[2].Seq != 8 {
		t.Fatalf("team y: %+v", ys)
	}
}
