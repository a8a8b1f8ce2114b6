package userns

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
)

// TestTakenMatchesPairwise checks the sorted lookup against comparing
// with every range, on ranges of any size that may overlap each other.
func TestTakenMatchesPairwise(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for round := range 200 {
		h := hostState{"/a": {}, "/b": {}}
		var all []Range
		for i := range rng.IntN(40) {
			r := Range{HostID: rng.Uint32N(1 << 22), Size: 1 + rng.Uint32N(1<<18)}
			h[[]string{"/a", "/b"}[i%2]][fmt.Sprint(i)] = r
			all = append(all, r)
		}
		tk := h.taken()
		for range 200 {
			q := Range{HostID: rng.Uint32N(1 << 22), Size: 1 + rng.Uint32N(1<<17)}
			want := false
			for _, o := range all {
				want = want || q.overlaps(o)
			}
			if got := tk.overlaps(q); got != want {
				t.Fatalf("round %d: overlaps(%+v) = %v, want %v among %+v", round, q, got, want, all)
			}
		}
	}
}

// manyTaken writes a state file in which the first n blocks of scope dir
// are taken, as a node with n sandboxes up has it.
func manyTaken(t testing.TB, dir string, n int) *Allocator {
	t.Helper()
	file := filepath.Join(dir, "state.json")
	m := map[string]Range{}
	for i := range n {
		m[fmt.Sprintf("sb-%05d", i)] = Range{HostID: DefaultFirst + uint32(i)*Size, Size: Size}
	}
	b, err := json.Marshal(hostState{dir: m})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(file, b, 0o600); err != nil {
		t.Fatal(err)
	}
	a, err := NewAllocator(file, dir, DefaultFirst, DefaultCount)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func TestAcquireAmongMany(t *testing.T) {
	dir := t.TempDir()
	a := manyTaken(t, dir, 3000)
	r, err := a.Acquire("new")
	if err != nil {
		t.Fatal(err)
	}
	if want := DefaultFirst + 3000*Size; r.HostID != want {
		t.Fatalf("Acquire = %d, want the first free block %d", r.HostID, want)
	}
	if err := a.Release("sb-01234"); err != nil {
		t.Fatal(err)
	}
	if r, err = a.Acquire("newer"); err != nil || r.HostID != DefaultFirst+1234*Size {
		t.Fatalf("Acquire = %+v, %v, want the released block %d", r, err, DefaultFirst+1234*Size)
	}
	free, err := a.Free(2)
	if err != nil || len(free) != 2 || free[0].HostID != DefaultFirst+3001*Size {
		t.Fatalf("Free(2) = %+v, %v", free, err)
	}
}

// BenchmarkAcquireAmong2000 is one create's Acquire and Release on a node
// with 2,000 sandboxes up.
func BenchmarkAcquireAmong2000(b *testing.B) {
	a := manyTaken(b, b.TempDir(), 2000)
	for b.Loop() {
		if _, err := a.Acquire("new"); err != nil {
			b.Fatal(err)
		}
		if err := a.Release("new"); err != nil {
			b.Fatal(err)
		}
	}
}

// TestVMUIDBlockNeverHandedOut fills the blocks below the VM runtime's
// uids: the next one is past them.
func TestVMUIDBlockNeverHandedOut(t *testing.T) {
	vmBlock := int((VMUIDBase - DefaultFirst) / Size)
	a := manyTaken(t, t.TempDir(), vmBlock)
	r, err := a.Acquire("after")
	if err != nil {
		t.Fatal(err)
	}
	if r.overlaps(Range{HostID: VMUIDBase, Size: VMUIDCount}) || r.HostID != DefaultFirst+uint32(vmBlock+1)*Size {
		t.Fatalf("Acquire = %+v, want block %d, past the VM uids at %d", r, vmBlock+1, VMUIDBase)
	}
	if free, err := a.Free(1); err != nil || len(free) != 1 || free[0].HostID != DefaultFirst+uint32(vmBlock+2)*Size {
		t.Fatalf("Free(1) = %+v, %v", free, err)
	}
}
