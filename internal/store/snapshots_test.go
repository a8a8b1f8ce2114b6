package store

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/sandbox"
)

func TestSnapshotCRUDAndReopen(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.db")
	s, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC()
	a := &sandbox.Snapshot{ID: "a", SandboxID: "sb", TemplateID: "t", State: sandbox.SnapshotCreating,
		CreatedAt: now.Add(time.Second), Labels: map[string]string{"k": "v"}}
	b := &sandbox.Snapshot{ID: "b", SandboxID: "sb", TemplateID: "t", State: sandbox.SnapshotReady, CreatedAt: now}
	for _, sn := range []*sandbox.Snapshot{a, b} {
		if err := s.CreateSnapshot(sn); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.CreateSnapshot(a); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("duplicate create: %v", err)
	}
	a.State = sandbox.SnapshotReady
	if err := s.PutSnapshot(a); err != nil {
		t.Fatal(err)
	}
	s.Close()

	if s, err = Open(path); err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	got, err := s.GetSnapshot("a")
	if err != nil || got.State != sandbox.SnapshotReady || got.Labels["k"] != "v" {
		t.Fatalf("get after reopen: %+v %v", got, err)
	}
	all, err := s.ListSnapshots()
	if err != nil || len(all) != 2 || all[0].ID != "b" || all[1].ID != "a" {
		t.Fatalf("list (oldest first): %+v %v", all, err)
	}
	if err := s.DeleteSnapshot("a"); err != nil {
		t.Fatal(err)
	}
	if err := s.DeleteSnapshot("a"); err != nil {
		t.Fatalf("delete of absent: %v", err)
	}
	if _, err := s.GetSnapshot("a"); !errdefs.IsNotFound(err) {
		t.Fatalf("get deleted: %v", err)
	}
}
