package catalog_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// testLeases: one holder at a time, the token raised at each change of
// holder, renewal keeps it, expiry (by the database's clock) and release
// hand it over, a later process of the same replica takes it at once, and
// the fencing check fails for a holder that lost it.
func testLeases(t *testing.T, c *catalog.Catalog) {
	const name = "loops"
	ttl := 600 * time.Millisecond
	mustAcquire := func(holder, replica string, want bool) catalog.Lease {
		t.Helper()
		l, ok, err := c.AcquireLease(ctx, name, holder, replica, ttl, false)
		if err != nil {
			t.Fatal(err)
		}
		if ok != want {
			t.Fatalf("%s acquires: %v, want %v (row %+v)", holder, ok, want, l)
		}
		t.Logf("%s acquire: ok=%v holder=%s token=%d", holder, ok, l.Holder, l.Token)
		return l
	}
	a := mustAcquire("a#1", "a", true)
	if a.Token != 1 || a.Holder != "a#1" {
		t.Fatalf("first lease %+v, want a#1 with token 1", a)
	}
	mustAcquire("b#1", "b", false)
	if l := mustAcquire("a#1", "a", true); l.Token != 1 {
		t.Fatalf("renewal changed the token: %+v", l)
	}
	if err := c.CheckLease(ctx, name, "a#1", 1); err != nil {
		t.Fatalf("holder's fencing check: %v", err)
	}
	if err := c.CheckLease(ctx, name, "b#1", 1); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("non-holder's fencing check: %v, want FailedPrecondition", err)
	}
	time.Sleep(ttl + 200*time.Millisecond)
	if err := c.CheckLease(ctx, name, "a#1", 1); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("fencing check after expiry: %v, want FailedPrecondition", err)
	}
	b := mustAcquire("b#1", "b", true)
	if b.Token != 2 {
		t.Fatalf("token after handover %d, want 2", b.Token)
	}
	mustAcquire("a#1", "a", false)
	if err := c.CheckLease(ctx, name, "a#1", 1); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("old holder's fencing check: %v", err)
	}
	// A restarted b (same replica, new process) takes its own lease at
	// once when it starts (takeOwn); the earlier process, if it still
	// ran (two processes given one replica ID), can no longer renew.
	if _, ok, _ := c.AcquireLease(ctx, name, "b#2", "b", ttl, false); ok {
		t.Fatalf("another process of b took the live lease without takeOwn")
	}
	l, ok, err := c.AcquireLease(ctx, name, "b#2", "b", ttl, true)
	if err != nil || !ok || l.Token != 3 {
		t.Fatalf("restarted b: ok=%v token %d (%v), want its lease with token 3", ok, l.Token, err)
	}
	mustAcquire("b#1", "b", false)
	if err := c.ReleaseLease(ctx, name, "b#2"); err != nil {
		t.Fatal(err)
	}
	if l := mustAcquire("a#2", "a", true); l.Token != 4 {
		t.Fatalf("token after release %d, want 4", l.Token)
	}
	if _, _, err := c.AcquireLease(ctx, name, "", "a", ttl, false); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("empty holder: %v", err)
	}

	// A row written under a lease (UpdateSandboxUnderLease): by its
	// holder with its token it is written (the control); once another
	// holder took the lease the same write is refused FailedPrecondition
	// and the row stays.
	if err := c.CreateSandbox(ctx, &catalog.Sandbox{ID: "fenced", TemplateID: "t", NodeID: "n1", State: catalog.StatePaused, StartedAt: time.Now()}); err != nil {
		t.Fatal(err)
	}
	fence := mustAcquire("a#2", "a", true)
	toNode := func(node string) func(*catalog.Sandbox) error {
		return func(r *catalog.Sandbox) error { r.NodeID = node; return nil }
	}
	if up, err := c.UpdateSandboxUnderLease(ctx, "fenced", name, "a#2", fence.Token, toNode("n2")); err != nil || up.NodeID != "n2" {
		t.Fatalf("holder's write under its lease: %+v %v, want the row on n2", up, err)
	}
	if _, ok, err := c.AcquireLease(ctx, name, "a#3", "a", ttl, true); err != nil || !ok {
		t.Fatalf("another holder takes the lease: %v %v", ok, err)
	}
	_, err = c.UpdateSandboxUnderLease(ctx, "fenced", name, "a#2", fence.Token, toNode("n3"))
	got, gerr := c.GetSandbox(ctx, "fenced")
	t.Logf("write under a lease taken by another holder: %v; row on %s", err, got.NodeID)
	if !errdefs.IsFailedPrecondition(err) || gerr != nil || got.NodeID != "n2" {
		t.Fatalf("write after losing the lease: %v, row %+v %v; want FailedPrecondition and the row on n2", err, got, gerr)
	}
}

// testLeaseHeld: LeaseHeld says whether a lease is held now by the
// database's clock (never taken, held, expired, released); ReleaseLease
// releases only for its holder and keeps the token; PruneLeases deletes
// old released rows.
func testLeaseHeld(t *testing.T, c *catalog.Catalog) {
	const name = "move/sb1"
	ttl := 600 * time.Millisecond
	held := func(want bool) {
		t.Helper()
		l, ok, err := c.LeaseHeld(ctx, name)
		if err != nil || ok != want {
			t.Fatalf("held: %v %+v %v, want %v", ok, l, err, want)
		}
		// HeldLeases, many names in one read, says the same.
		many, err := c.HeldLeases(ctx, []string{"move/never-taken", name})
		if got, in := many[name]; err != nil || in != want || len(many) > 1 || in && got.Holder != l.Holder {
			t.Fatalf("HeldLeases: %+v %v, want %s held %v as LeaseHeld has it (%+v)", many, err, name, want, l)
		}
	}
	held(false) // never taken
	// What a verb or route resolve on a shared catalog adds: one read.
	began := time.Now()
	const reads = 200
	for range reads {
		if _, _, err := c.LeaseHeld(ctx, name); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("LeaseHeld: %s a read (%d reads)", time.Since(began)/reads, reads)
	if _, ok, err := c.AcquireLease(ctx, name, "a#1", "a", ttl, false); err != nil || !ok {
		t.Fatalf("acquire: %v %v", ok, err)
	}
	held(true)
	time.Sleep(ttl + 200*time.Millisecond)
	held(false) // expired
	if _, ok, err := c.AcquireLease(ctx, name, "b#1", "b", ttl, false); err != nil || !ok {
		t.Fatalf("acquire after expiry: %v %v", ok, err)
	}
	if err := c.ReleaseLease(ctx, name, "a#1"); err != nil {
		t.Fatal(err)
	}
	held(true) // not a's to release
	if err := c.ReleaseLease(ctx, name, "b#1"); err != nil {
		t.Fatal(err)
	}
	held(false)
	// The released row keeps its token: the next holder's is higher
	// (a quiesce's answer carries the move's token; quiesce.go).
	l, ok, err := c.AcquireLease(ctx, name, "b#1", "b", ttl, false)
	if err != nil || !ok || l.Token != 3 {
		t.Fatalf("acquire after release: %+v %v %v, want token 3", l, ok, err)
	}
	if err := c.ReleaseLease(ctx, name, "b#1"); err != nil {
		t.Fatal(err)
	}
	// PruneLeases deletes the prefix's rows released longer ago than
	// age, and no other: a recent release, a held lease, another prefix.
	const other, live = "loops/x", "move/live"
	for _, n := range []string{other, live} {
		if _, ok, err := c.AcquireLease(ctx, n, "a#1", "a", time.Hour, false); err != nil || !ok {
			t.Fatalf("acquire %s: %v %v", n, ok, err)
		}
	}
	if err := c.ReleaseLease(ctx, other, "a#1"); err != nil {
		t.Fatal(err)
	}
	if err := c.PruneLeases(ctx, "move/", time.Hour); err != nil {
		t.Fatal(err)
	}
	if l, err := c.GetLease(ctx, name); err != nil || l.Token != 3 {
		t.Fatalf("row released just now after a prune: %+v %v, want it with token 3", l, err)
	}
	time.Sleep(300 * time.Millisecond)
	if err := c.PruneLeases(ctx, "move/", 100*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if _, err := c.GetLease(ctx, name); !errdefs.IsNotFound(err) {
		t.Fatalf("row released past the age after a prune: %v, want NotFound", err)
	}
	// Pruned, released, held, never taken: only the held one, with its
	// holder and token. More names than one statement takes (500).
	names := []string{name, other, live}
	for i := range 1200 {
		names = append(names, fmt.Sprintf("move/none-%d", i))
	}
	many, err := c.HeldLeases(ctx, names)
	if got := many[live]; err != nil || len(many) != 1 || got.Holder != "a#1" || got.Token == 0 {
		t.Fatalf("HeldLeases: %+v %v, want only %s, held by a#1", many, err, live)
	}
	for _, n := range []string{other, live} {
		if _, err := c.GetLease(ctx, n); err != nil {
			t.Fatalf("%s after a prune of move/: %v, want its row", n, err)
		}
	}
	held(false)
}
