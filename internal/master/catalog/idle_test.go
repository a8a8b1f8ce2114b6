package catalog_test

import (
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/master/catalog"
)

func testIdleTimeout(t *testing.T, c *catalog.Catalog) {
	now := time.Now()
	for id, d := range map[string]time.Duration{"idle-a": 90 * time.Second, "idle-none": 0} {
		s := newSandbox(id, now, nil)
		s.IdleTimeout = d
		if err := c.CreateSandbox(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	p := newSandbox("idle-paused", now, nil)
	p.State, p.IdleTimeout = catalog.StatePaused, time.Minute
	if err := c.CreateSandbox(ctx, p); err != nil {
		t.Fatal(err)
	}
	if got, err := c.GetSandbox(ctx, "idle-a"); err != nil || got.IdleTimeout != 90*time.Second {
		t.Fatalf("round trip: %v %v", got, err)
	}
	got, err := c.WithIdleTimeout(ctx)
	if err != nil || ids(got) != "[idle-a]" {
		t.Fatalf("with idle timeout: %s %v", ids(got), err)
	}
	if _, err := c.UpdateSandbox(ctx, "idle-a", func(s *catalog.Sandbox) error { s.IdleTimeout = 0; return nil }); err != nil {
		t.Fatal(err)
	}
	if got, _ := c.WithIdleTimeout(ctx); len(got) != 0 {
		t.Fatalf("after update: %s", ids(got))
	}
}
