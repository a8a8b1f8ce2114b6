package catalog

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"
)

// TestMeasureGroupCommit times what a burst of creates asks of the
// catalog, with and without the group committer: c sandboxes at once, each
// with cubemaster's four writes (its row, its node, Running, the
// "sandbox created" event). It only runs with CUBE_CATALOG_MEASURE=<c>
// (docs/bench.md has its figures).
func TestMeasureGroupCommit(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("CUBE_CATALOG_MEASURE"))
	if n <= 0 {
		t.Skip("set CUBE_CATALOG_MEASURE=<concurrent creates> to measure")
	}
	ctx := context.Background()
	for round := range 3 {
		for _, grouped := range []bool{false, true} {
			c, err := Open(ctx, SQLite, filepath.Join(t.TempDir(), "catalog.db"))
			if err != nil {
				t.Fatal(err)
			}
			if !grouped {
				c.stopCommitter()
				c.gc = nil
			}
			lat := make([]time.Duration, n)
			var wg sync.WaitGroup
			begin := time.Now()
			for i := range n {
				wg.Go(func() {
					t0 := time.Now()
					id := fmt.Sprintf("sb%d", i)
					if err := c.CreateSandbox(ctx, &Sandbox{ID: id, TemplateID: "t", State: StateCreating, StartedAt: t0}); err != nil {
						t.Error(err)
						return
					}
					for _, set := range []func(*Sandbox){func(s *Sandbox) { s.NodeID = "n1" }, func(s *Sandbox) { s.State = StateRunning }} {
						if _, err := c.UpdateSandbox(ctx, id, func(s *Sandbox) error { set(s); return nil }); err != nil {
							t.Error(err)
							return
						}
					}
					if err := c.AddEvent(ctx, Event{SandboxID: id, At: time.Now(), Level: "info", Message: "sandbox created"}); err != nil {
						t.Error(err)
					}
					lat[i] = time.Since(t0)
				})
			}
			wg.Wait()
			wall := time.Since(begin)
			var slowest time.Duration
			for _, d := range lat {
				slowest = max(slowest, d)
			}
			commits, writes := c.GroupCommits()
			t.Logf("round %d grouped=%v: %d creates x 4 writes in %s (slowest create %s); %d commits for %d writes",
				round, grouped, n, wall.Round(100*time.Microsecond), slowest.Round(100*time.Microsecond), commits, writes)
			c.Close()
		}
	}
}
