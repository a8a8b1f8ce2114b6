// Package userns gives each runc sandbox its own block of host user and
// group IDs and an idmapped view of its root filesystem through them.
//
// A sandbox's user namespace maps container IDs 0..Size-1 onto host IDs
// HostID..HostID+Size-1. Allocator hands out non-overlapping blocks and
// keeps them in a small file, so a restarted process (or another one
// sharing the directory) sees every block still in use. NewNamespace
// creates such a namespace, owned by the block's base UID, and
// MountIDMapped shows a filesystem owned by container IDs (a template's
// files, owned by 0..65535 on disk) to it as its own, without rewriting a
// single inode.
package userns

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// Size is the number of IDs each sandbox gets: the full 16-bit range that
// images assume (nobody is 65534).
const Size = 65536

const (
	// DefaultFirst is the first host ID handed out: 2^30, inside the range
	// systemd reserves for containers (524288-1879048191) and far above
	// every regular, system and dynamic user.
	DefaultFirst uint32 = 1 << 30
	// DefaultCount blocks of Size end at host ID 1342177279, still
	// inside that range.
	DefaultCount = 4096
)

// Range is one sandbox's block: container ID 0 is host ID HostID.
type Range struct {
	HostID uint32 `json:"host_id"`
	Size   uint32 `json:"size"`
}

// Contains reports whether host ID id lies in r.
func (r Range) Contains(id uint32) bool { return id >= r.HostID && id-r.HostID < r.Size }

func (r Range) overlaps(o Range) bool {
	return uint64(r.HostID) < uint64(o.HostID)+uint64(o.Size) && uint64(o.HostID) < uint64(r.HostID)+uint64(r.Size)
}

// Allocator hands out Ranges by sandbox ID. Its state is one JSON file
// guarded by an flock on a lock file next to it, so allocations are
// atomic across goroutines and processes and survive restarts.
type Allocator struct {
	file, lock string
	first      uint32
	count      int
}

// NewAllocator keeps its state as <dir>/<name> and <dir>/<name>.lock and
// hands out count blocks of Size starting at host ID first.
func NewAllocator(dir, name string, first uint32, count int) (*Allocator, error) {
	if first == 0 {
		first = DefaultFirst
	}
	if count <= 0 {
		count = DefaultCount
	}
	if first < Size || uint64(first)+uint64(count)*Size > 1<<32-1 {
		return nil, fmt.Errorf("userns: %d blocks from host ID %d do not fit between 65536 and 2^32-2: %w", count, first, errdefs.ErrInvalidArgument)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("userns: %w", err)
	}
	return &Allocator{
		file:  filepath.Join(dir, name),
		lock:  filepath.Join(dir, name+".lock"),
		first: first,
		count: count,
	}, nil
}

// Acquire returns id's range, allocating a free block when id has none
// yet (so a retried start reuses its block): the first free one of
// prefer (blocks by host ID that the caller has something ready for),
// else the lowest.
func (a *Allocator) Acquire(id string, prefer ...uint32) (Range, error) {
	var got Range
	err := a.update(func(m map[string]Range) error {
		if r, ok := m[id]; ok {
			got = r
			return nil
		}
		for _, h := range prefer {
			r := Range{HostID: h, Size: Size}
			if a.inBounds(r) && !overlapsAny(r, m) {
				m[id], got = r, r
				return nil
			}
		}
		for i := range a.count {
			r := Range{HostID: a.first + uint32(i)*Size, Size: Size}
			if !overlapsAny(r, m) {
				m[id], got = r, r
				return nil
			}
		}
		return fmt.Errorf("userns: all %d ID ranges are in use: %w", a.count, errdefs.ErrResourceExhausted)
	})
	return got, err
}

// Free returns up to n free blocks, lowest first.
func (a *Allocator) Free(n int) ([]Range, error) {
	m, err := a.All()
	if err != nil {
		return nil, err
	}
	var out []Range
	for i := 0; i < a.count && len(out) < n; i++ {
		r := Range{HostID: a.first + uint32(i)*Size, Size: Size}
		if !overlapsAny(r, m) {
			out = append(out, r)
		}
	}
	return out, nil
}

// inBounds reports whether r is one of a's blocks.
func (a *Allocator) inBounds(r Range) bool {
	return r.HostID >= a.first && (r.HostID-a.first)%Size == 0 && int((r.HostID-a.first)/Size) < a.count
}

// Release frees id's range; releasing an id without one is a no-op.
func (a *Allocator) Release(id string) error {
	return a.update(func(m map[string]Range) error {
		delete(m, id)
		return nil
	})
}

// Get returns id's range, if it has one.
func (a *Allocator) Get(id string) (Range, bool, error) {
	m, err := a.All()
	if err != nil {
		return Range{}, false, err
	}
	r, ok := m[id]
	return r, ok, nil
}

// All returns every allocation.
func (a *Allocator) All() (map[string]Range, error) {
	var out map[string]Range
	err := a.locked(unix.LOCK_SH, func() error {
		m, err := a.read()
		out = m
		return err
	})
	return out, err
}

// IDs returns the allocated sandbox IDs, sorted.
func (a *Allocator) IDs() ([]string, error) {
	m, err := a.All()
	if err != nil {
		return nil, err
	}
	return slices.Sorted(maps.Keys(m)), nil
}

func overlapsAny(r Range, m map[string]Range) bool {
	for _, o := range m {
		if r.overlaps(o) {
			return true
		}
	}
	return false
}

func (a *Allocator) update(fn func(map[string]Range) error) error {
	return a.locked(unix.LOCK_EX, func() error {
		m, err := a.read()
		if err != nil {
			return err
		}
		if err := fn(m); err != nil {
			return err
		}
		b, err := json.Marshal(m)
		if err != nil {
			return err
		}
		// Written aside and renamed: a crash mid-write never leaves a
		// truncated file that would forget every allocation.
		tmp := a.file + ".tmp"
		if err := os.WriteFile(tmp, b, 0o600); err != nil {
			return fmt.Errorf("userns: %w", err)
		}
		if err := os.Rename(tmp, a.file); err != nil {
			return fmt.Errorf("userns: %w", err)
		}
		return nil
	})
}

func (a *Allocator) read() (map[string]Range, error) {
	m := map[string]Range{}
	b, err := os.ReadFile(a.file)
	if errors.Is(err, os.ErrNotExist) {
		return m, nil
	}
	if err != nil {
		return nil, fmt.Errorf("userns: %w", err)
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("userns: %s: %w: %w", a.file, errdefs.ErrInternal, err)
	}
	return m, nil
}

func (a *Allocator) locked(how int, fn func() error) error {
	f, err := os.OpenFile(a.lock, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("userns: %w", err)
	}
	defer f.Close() // closing drops the lock
	for {
		err = unix.Flock(int(f.Fd()), how)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		return fmt.Errorf("userns: lock %s: %w", a.lock, err)
	}
	return fn()
}
