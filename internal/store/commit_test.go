package store

import (
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/sandbox"
)

func (s *Store) commitCount() uint64 {
	s.group.mu.Lock()
	defer s.group.mu.Unlock()
	return s.group.commits
}

func (s *Store) pendingCount() int {
	s.group.mu.Lock()
	defer s.group.mu.Unlock()
	return len(s.group.pending)
}

// Writes that arrive while a commit holds the file all commit together
// in the next one; a write whose function fails inside that group gets
// its own error and fails none of the others.
func TestGroupCommit(t *testing.T) {
	s, err := Open(filepath.Join(t.TempDir(), "state.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	if err := s.CreateSandbox(&sandbox.Record{ID: "exists", State: lifecycle.Running}); err != nil {
		t.Fatal(err)
	}
	base := s.commitCount()

	// Hold the write lock, as a commit's fsync does.
	tx, err := s.db.Begin(true)
	if err != nil {
		t.Fatal(err)
	}
	const n = 50
	errs := make([]error, n+1)
	var wg sync.WaitGroup
	write := func(i int) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id := fmt.Sprintf("sb%02d", i)
			if i == n {
				id = "exists" // fails: already there
			}
			errs[i] = s.CreateSandbox(&sandbox.Record{ID: id, State: lifecycle.Creating})
		}()
	}
	waitFor := func(what string, ok func() bool) {
		for deadline := time.Now().Add(10 * time.Second); !ok(); time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s", what)
			}
		}
	}
	// The first write's commit waits for the lock; the others queue
	// behind it.
	write(0)
	waitFor("the first commit", func() bool { return s.commitCount() == base+1 })
	for i := 1; i <= n; i++ {
		write(i)
	}
	waitFor("the queued writes", func() bool { return s.pendingCount() == n })
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	for i := range n {
		if errs[i] != nil {
			t.Errorf("write %d: %v", i, errs[i])
		}
	}
	if !errdefs.IsAlreadyExists(errs[n]) {
		t.Errorf("duplicate create in the group: %v, want already exists", errs[n])
	}
	recs, err := s.ListSandboxes()
	if err != nil || len(recs) != n+1 {
		t.Fatalf("records: %d (%v), want %d", len(recs), err, n+1)
	}
	// One commit for the write that found the file busy, one for the
	// group behind it (run again without the failing write: the failed
	// attempt is not counted).
	if c := s.commitCount() - base; c != 2 {
		t.Errorf("%d commits for %d concurrent writes, want 2", c, n+1)
	}
	t.Logf("%d concurrent writes in %d commits", n+1, s.commitCount()-base)

	// A lone write commits at once, in a commit of its own.
	begin := time.Now()
	if err := s.PutSandbox(&sandbox.Record{ID: "lone", State: lifecycle.Running}); err != nil {
		t.Fatal(err)
	}
	t.Logf("lone write: %v", time.Since(begin))
}
