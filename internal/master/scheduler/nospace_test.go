package scheduler_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/scheduler"
)

// TestPlaceNoSpace: a node whose disk is full is skipped for the next;
// when every node tried is full, the placement fails as ErrNoSpace (the
// API's 507), naming each node's filesystem. The control: one node full
// and another merely busy stays ResourceExhausted (a 429 to retry).
func TestPlaceNoSpace(t *testing.T) {
	ctx := context.Background()
	nodes := []*scheduler.Node{node("a"), node("b")}
	full := func(id string) error {
		return fmt.Errorf("node %s: clone: (filesystem full: /var/lib/cube (xfs) has 0 B of 20 GiB free): %w", id, errdefs.ErrNoSpace)
	}
	try := func(fail map[string]error) func(context.Context, *scheduler.Node) error {
		return func(_ context.Context, n *scheduler.Node) error { return fail[n.ID] }
	}
	got, err := newSched().Place(ctx, nodes, req, try(map[string]error{"a": full("a")}))
	if err != nil || got.ID != "b" {
		t.Fatalf("one full node: %v %v, want placed on b", got, err)
	}
	_, err = newSched().Place(ctx, nodes, req, try(map[string]error{"a": full("a"), "b": full("b")}))
	if !errdefs.IsNoSpace(err) {
		t.Fatalf("every node full: %v, want ErrNoSpace", err)
	}
	// A full disk does not pass in seconds: nothing to wait for.
	if nn := (*scheduler.NoNodeError)(nil); !errors.As(err, &nn) || nn.Transient() {
		t.Fatalf("every node full: transient, want a placement not worth waiting for")
	}
	t.Logf("every node full: %v", err)
	_, err = newSched().Place(ctx, nodes, req, try(map[string]error{
		"a": full("a"), "b": fmt.Errorf("create limit: %w", errdefs.ErrResourceExhausted),
	}))
	if errdefs.IsNoSpace(err) || !errdefs.IsResourceExhausted(err) {
		t.Fatalf("one full, one busy: %v, want ResourceExhausted only", err)
	}
	if nn := (*scheduler.NoNodeError)(nil); !errors.As(err, &nn) || !nn.Transient() {
		t.Fatalf("one full, one busy: not transient, want a placement worth trying again")
	}
}
