package userns

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/cubesandbox/cube/internal/nospace/nospacetest"
)

// TestAllocatorFullDisk: on a full run dir an Acquire fails with ENOSPC
// and leaves no temp file, while releases (the undo of a failed create)
// still succeed: an ID without a range needs no write, one with a range
// is overwritten in place. The same Acquire succeeds once space returns.
func TestAllocatorFullDisk(t *testing.T) {
	dir := nospacetest.Mount(t, "tmpfs", 1)
	a, err := NewAllocator(filepath.Join(dir, "userns.json"), dir, DefaultFirst, 8)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"a", "b"} {
		if _, err := a.Acquire(id); err != nil {
			t.Fatal(err)
		}
	}
	free := nospacetest.Fill(t, dir)

	_, err = a.Acquire("c")
	t.Logf("acquire on a full run dir: %v", err)
	if !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("acquire on a full disk: %v, want ENOSPC", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "userns.json.tmp")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("failed write left its temp file: %v", err)
	}
	if err := a.Release("c"); err != nil {
		t.Fatalf("release of an ID without a range: %v", err)
	}
	if err := a.Release("a"); err != nil {
		t.Fatalf("release on a full disk: %v", err)
	}
	// A fresh allocator reads what the overwrite left: b only.
	b, err := NewAllocator(filepath.Join(dir, "userns.json"), dir, DefaultFirst, 8)
	if err != nil {
		t.Fatal(err)
	}
	if ids, err := b.IDs(); err != nil || len(ids) != 1 || ids[0] != "b" {
		t.Fatalf("after release in place: %v %v", ids, err)
	}

	free()
	if _, err := a.Acquire("c"); err != nil {
		t.Fatalf("acquire after freeing space: %v", err)
	}
	if ids, _ := b.IDs(); len(ids) != 2 {
		t.Fatalf("ids %v", ids)
	}
}
