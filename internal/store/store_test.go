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
	"github.com/cubesandbox/cube/internal/sandboxid"
)

func TestSandboxCRUDAndReopen(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.db")
	s, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	r := &sandbox.Record{ID: "sb1", State: lifecycle.Creating, CreatedAt: time.Now(),
		Disk: &sandbox.Disk{Path: "/pool/sb1/disk.img"}}
	if err := s.CreateSandbox(r); err != nil {
		t.Fatal(err)
	}
	if err := s.CreateSandbox(r); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("duplicate create: %v", err)
	}
	r.State = lifecycle.Running
	if err := s.PutSandbox(r); err != nil {
		t.Fatal(err)
	}
	if err := s.PutJournal(&sandbox.JournalEntry{SandboxID: "sb1", Attempts: 1}); err != nil {
		t.Fatal(err)
	}
	s.Close()

	s, err = Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	got, err := s.GetSandbox("sb1")
	if err != nil || got.State != lifecycle.Running || got.Disk.Path != "/pool/sb1/disk.img" {
		t.Fatalf("after reopen: %+v, %v", got, err)
	}
	if j, _ := s.ListJournal(); len(j) != 1 {
		t.Fatalf("journal: %v", j)
	}
	if err := s.FinishDestroy("sb1"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.GetSandbox("sb1"); !errdefs.IsNotFound(err) {
		t.Fatalf("after delete: %v", err)
	}
	if j, _ := s.ListJournal(); len(j) != 0 {
		t.Fatalf("journal after finish: %v", j)
	}
}

func TestConcurrentCreates(t *testing.T) {
	s, err := Open(filepath.Join(t.TempDir(), "state.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var wg sync.WaitGroup
	for i := range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := s.CreateSandbox(&sandbox.Record{ID: fmt.Sprintf("sb%d", i)}); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if l, _ := s.ListSandboxes(); len(l) != 50 {
		t.Fatalf("got %d records", len(l))
	}
}

func TestSecondOpenFailsFast(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.db")
	s, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	start := time.Now()
	if _, err := Open(path); err == nil {
		t.Fatal("second open succeeded")
	}
	if time.Since(start) > 5*time.Second {
		t.Fatal("second open waited too long")
	}
}

func TestIDs(t *testing.T) {
	for range 100 {
		if err := sandboxid.Validate("sandbox", sandboxid.New()); err != nil {
			t.Fatal(err)
		}
	}
	for _, bad := range []string{"", "-a", "a-", "A", "a_b", "a/b", "../x", string(make([]byte, 64))} {
		if err := sandboxid.Validate("sandbox", bad); !errdefs.IsInvalidArgument(err) {
			t.Errorf("%q accepted", bad)
		}
	}
}

func TestReplaceSandbox(t *testing.T) {
	s, err := Open(filepath.Join(t.TempDir(), "state.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for _, id := range []string{"pool-1", "taken"} {
		if err := s.CreateSandbox(&sandbox.Record{ID: id, State: lifecycle.Paused}); err != nil {
			t.Fatal(err)
		}
	}
	// Refused either way leaves both records as they were.
	if err := s.ReplaceSandbox("pool-1", &sandbox.Record{ID: "taken"}); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("replace onto an existing ID: %v", err)
	}
	if err := s.ReplaceSandbox("gone", &sandbox.Record{ID: "sb"}); !errdefs.IsNotFound(err) {
		t.Fatalf("replace of an absent record: %v", err)
	}
	if _, err := s.GetSandbox("pool-1"); err != nil {
		t.Fatalf("refused replace removed the old record: %v", err)
	}
	if _, err := s.GetSandbox("sb"); !errdefs.IsNotFound(err) {
		t.Fatalf("refused replace wrote the new record: %v", err)
	}
	if err := s.ReplaceSandbox("pool-1", &sandbox.Record{ID: "sb", HostID: "pool-1", State: lifecycle.Creating}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.GetSandbox("pool-1"); !errdefs.IsNotFound(err) {
		t.Fatalf("old record after replace: %v", err)
	}
	got, err := s.GetSandbox("sb")
	if err != nil || got.HostKey() != "pool-1" {
		t.Fatalf("new record after replace: %+v %v", got, err)
	}
}
