package store

import (
	"encoding/json"
	"path/filepath"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// onDisk reads id's record as committed, bypassing the queue.
func onDisk(t *testing.T, s *Store, id string) (lifecycle.State, bool) {
	t.Helper()
	var st lifecycle.State
	found := false
	err := s.db.View(func(tx *bolt.Tx) error {
		data := tx.Bucket(bucketSandboxes).Get([]byte(id))
		if data == nil {
			return nil
		}
		found = true
		var r sandbox.Record
		if err := json.Unmarshal(data, &r); err != nil {
			return err
		}
		st = r.State
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return st, found
}

func rec(id string, st lifecycle.State) *sandbox.Record {
	return &sandbox.Record{ID: id, State: st, CreatedAt: time.Now()}
}

// holdFlush stops the background writer before its commit until Close.
func holdFlush(t *testing.T) {
	t.Helper()
	if err := failpoint.Enable("store/sandbox-flush", "hang"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { failpoint.Disable("store/sandbox-flush") })
}

func TestLazyPutCommitsInBackground(t *testing.T) {
	s, err := Open(filepath.Join(t.TempDir(), "state.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.CreateSandbox(rec("a", lifecycle.Running)); err != nil {
		t.Fatal(err)
	}
	if err := s.PutSandboxLazy(rec("a", lifecycle.Paused)); err != nil {
		t.Fatal(err)
	}
	if got, err := s.GetSandbox("a"); err != nil || got.State != lifecycle.Paused {
		t.Fatalf("read after a lazy put: %+v %v", got, err)
	}
	// The queue entry goes just after the commit lands: wait for both.
	deadline := time.Now().Add(10 * time.Second)
	for {
		st, _ := onDisk(t, s, "a")
		q := s.lazy.queuedAll()
		if st == lifecycle.Paused && len(q) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the background writer did not commit the record and drop it from the queue: on disk %q, queued %d", st, len(q))
		}
		time.Sleep(time.Millisecond)
	}
}

// TestLazyPutSuperseded: a record queued by PutSandboxLazy never lands
// over a later synchronous write of the same sandbox (an update, a
// delete), nor is lost by a synchronous write that failed; the queued
// record of a sandbox nothing else wrote is committed at Close (the
// control: without a later write, the queue does reach the disk).
func TestLazyPutSuperseded(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.db")
	s, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	holdFlush(t)
	for _, id := range []string{"kept", "updated", "deleted", "finished", "failed"} {
		if err := s.CreateSandbox(rec(id, lifecycle.Running)); err != nil {
			t.Fatal(err)
		}
		if err := s.PutSandboxLazy(rec(id, lifecycle.Paused)); err != nil {
			t.Fatal(err)
		}
	}
	if st, _ := onDisk(t, s, "kept"); st != lifecycle.Running {
		t.Fatalf("held writer committed anyway: %s on disk", st)
	}
	all, err := s.ListSandboxes()
	if err != nil || len(all) != 5 {
		t.Fatalf("list: %d records, %v", len(all), err)
	}
	for _, r := range all {
		if r.State != lifecycle.Paused {
			t.Fatalf("list shows %s %s, not the queued record", r.ID, r.State)
		}
	}
	if err := s.PutSandbox(rec("updated", lifecycle.Destroying)); err != nil {
		t.Fatal(err)
	}
	if err := s.DeleteSandbox("deleted"); err != nil {
		t.Fatal(err)
	}
	if err := s.FinishDestroy("finished"); err != nil {
		t.Fatal(err)
	}
	if err := s.CreateSandbox(rec("failed", lifecycle.Creating)); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("create over an existing record: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}

	s, err = Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for id, want := range map[string]lifecycle.State{"kept": lifecycle.Paused, "updated": lifecycle.Destroying, "failed": lifecycle.Paused} {
		if st, ok := onDisk(t, s, id); !ok || st != want {
			t.Errorf("%s on disk: %s (present %v), want %s", id, st, ok, want)
		}
	}
	for _, id := range []string{"deleted", "finished"} {
		if _, ok := onDisk(t, s, id); ok {
			t.Errorf("%s: the queued record brought a deleted sandbox back", id)
		}
	}
}
