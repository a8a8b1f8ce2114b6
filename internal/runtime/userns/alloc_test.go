package userns

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"

	"github.com/cubesandbox/cube/internal/errdefs"
)

func TestAllocatorDisjointReleasedPersistent(t *testing.T) {
	dir := t.TempDir()
	a, err := NewAllocator(filepath.Join(dir, "state.json"), dir, DefaultFirst, 3)
	if err != nil {
		t.Fatal(err)
	}
	r1, err := a.Acquire("a")
	if err != nil {
		t.Fatal(err)
	}
	r2, err := a.Acquire("b")
	if err != nil {
		t.Fatal(err)
	}
	if r1.HostID != DefaultFirst || r2.HostID != DefaultFirst+Size || r1.overlaps(r2) {
		t.Fatalf("ranges %+v %+v", r1, r2)
	}
	if again, _ := a.Acquire("a"); again != r1 {
		t.Errorf("second Acquire of a = %+v, want %+v", again, r1)
	}
	// Another allocator on the same state (a restarted process) sees both.
	b, err := NewAllocator(filepath.Join(dir, "state.json"), dir, DefaultFirst, 3)
	if err != nil {
		t.Fatal(err)
	}
	if got, ok, err := b.Get("b"); err != nil || !ok || got != r2 {
		t.Fatalf("restarted allocator: b = %+v %v %v", got, ok, err)
	}
	if _, err := b.Acquire("c"); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Acquire("d"); !errdefs.IsResourceExhausted(err) {
		t.Fatalf("fourth range of three: %v, want resource exhausted", err)
	}
	if err := a.Release("a"); err != nil {
		t.Fatal(err)
	}
	if err := a.Release("a"); err != nil {
		t.Fatalf("second release: %v", err)
	}
	if got, err := b.Acquire("d"); err != nil || got != r1 {
		t.Fatalf("freed block not reused: %+v %v", got, err)
	}
	if err := b.Release("b"); err != nil {
		t.Fatal(err)
	}
	if free, err := b.Free(5); err != nil || len(free) != 1 || free[0] != r2 {
		t.Fatalf("Free = %+v, %v; want [%+v]", free, err, r2)
	}
}

func TestAllocatorPrefers(t *testing.T) {
	a, err := NewAllocator(filepath.Join(t.TempDir(), "state.json"), "/", DefaultFirst, 4)
	if err != nil {
		t.Fatal(err)
	}
	third := DefaultFirst + 2*Size
	if r, err := a.Acquire("a", DefaultFirst+1, third); err != nil || r.HostID != third {
		t.Fatalf("Acquire preferring block 2 (and a non-block) = %+v, %v", r, err)
	}
	if r, err := a.Acquire("b", third); err != nil || r.HostID != DefaultFirst {
		t.Fatalf("Acquire preferring a taken block = %+v, %v; want the lowest free", r, err)
	}
}

func TestAllocatorConcurrent(t *testing.T) {
	dir := t.TempDir()
	const n = 32
	var wg sync.WaitGroup
	got := make([]Range, n)
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Each goroutine its own Allocator, as separate processes.
			a, err := NewAllocator(filepath.Join(dir, "state.json"), dir, 0, 0)
			if err == nil {
				got[i], err = a.Acquire(fmt.Sprint("sb", i))
			}
			errs[i] = err
		}()
	}
	wg.Wait()
	for i := range n {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		for j := range i {
			if got[i].overlaps(got[j]) {
				t.Fatalf("sb%d %+v overlaps sb%d %+v", i, got[i], j, got[j])
			}
		}
	}
}

func TestAllocatorRejectsBadRange(t *testing.T) {
	for _, c := range []struct {
		first uint32
		count int
	}{{1, 1}, {1 << 31, 1 << 15}} {
		if _, err := NewAllocator(filepath.Join(t.TempDir(), "s"), "/", c.first, c.count); !errdefs.IsInvalidArgument(err) {
			t.Errorf("first %d count %d: %v, want invalid argument", c.first, c.count, err)
		}
	}
}

// Two drivers on one host (two runc roots) share the host's file: their
// blocks never overlap, though each sees only its own sandboxes, and the
// blocks of a root that is gone are free again.
func TestAllocatorHostWide(t *testing.T) {
	file := filepath.Join(t.TempDir(), "userns.json")
	// Blocks far above those the host's own sandboxes take (they share
	// this range, and the test looks for processes under its blocks).
	first := DefaultFirst + 3000*Size
	rootA, rootB := t.TempDir(), t.TempDir()
	a, err := NewAllocator(file, rootA, first, 2)
	if err != nil {
		t.Fatal(err)
	}
	b, err := NewAllocator(file, rootB, first, 2)
	if err != nil {
		t.Fatal(err)
	}
	ra, err := a.Acquire("sb")
	if err != nil {
		t.Fatal(err)
	}
	rb, err := b.Acquire("sb") // the same sandbox ID in another root
	if err != nil {
		t.Fatal(err)
	}
	if ra.overlaps(rb) {
		t.Fatalf("roots share a block: %+v %+v", ra, rb)
	}
	if _, err := b.Acquire("other"); !errdefs.IsResourceExhausted(err) {
		t.Fatalf("third block of two across roots: %v, want resource exhausted", err)
	}
	if ids, _ := b.IDs(); len(ids) != 1 || ids[0] != "sb" {
		t.Fatalf("root B sees %v, want only its own sandbox", ids)
	}
	// A root that is missing while a process still runs under its block
	// (a mount not up yet) keeps the block.
	if os.Geteuid() == 0 {
		p := exec.Command("sleep", "60")
		p.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: ra.HostID, Gid: ra.HostID}}
		if err := p.Start(); err != nil {
			t.Fatal(err)
		}
		defer func() { _ = p.Process.Kill(); _ = p.Wait() }()
		if err := os.Remove(rootA); err != nil {
			t.Fatal(err)
		}
		if r, err := b.Acquire("other"); !errdefs.IsResourceExhausted(err) {
			t.Fatalf("block of a missing root with a process under it handed out: %+v, %v", r, err)
		}
		_ = p.Process.Kill()
		_ = p.Wait()
	} else if err := os.Remove(rootA); err != nil {
		t.Fatal(err)
	}
	if r, err := b.Acquire("other"); err != nil || r != ra {
		t.Fatalf("block of a removed root not reused: %+v, %v", r, err)
	}

	// Control: with a file per root, as before, two roots hand out the
	// same block.
	c, _ := NewAllocator(filepath.Join(t.TempDir(), "userns.json"), t.TempDir(), DefaultFirst, 2)
	d, _ := NewAllocator(filepath.Join(t.TempDir(), "userns.json"), t.TempDir(), DefaultFirst, 2)
	rc, err1 := c.Acquire("sb")
	rd, err2 := d.Acquire("sb")
	if err1 != nil || err2 != nil || !rc.overlaps(rd) {
		t.Fatalf("control: per-root files gave %+v and %+v (%v, %v), want the same block", rc, rd, err1, err2)
	}
}

// A per-root file of the earlier layout moves into the host's file.
func TestAllocatorImport(t *testing.T) {
	dir := t.TempDir()
	old := filepath.Join(dir, "cube:userns.json")
	if err := os.WriteFile(old, []byte(`{"sb":{"host_id":1073872896,"size":65536}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	a, err := NewAllocator(filepath.Join(t.TempDir(), "userns.json"), dir, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Import(old); err != nil {
		t.Fatal(err)
	}
	if r, ok, err := a.Get("sb"); err != nil || !ok || r.HostID != DefaultFirst+2*Size {
		t.Fatalf("imported sb = %+v %v %v", r, ok, err)
	}
	if _, err := os.Stat(old); !os.IsNotExist(err) {
		t.Fatalf("old file still there: %v", err)
	}
	if r, err := a.Acquire("new"); err != nil || r.HostID != DefaultFirst {
		t.Fatalf("Acquire after import = %+v, %v", r, err)
	}
	if err := a.Import(old); err != nil {
		t.Fatalf("second import (no file): %v", err)
	}
}
