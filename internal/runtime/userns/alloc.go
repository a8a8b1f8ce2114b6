// Package userns gives each runc sandbox its own block of host user and
// group IDs and an idmapped view of its root filesystem through them.
//
// A sandbox's user namespace maps container IDs 0..Size-1 onto host IDs
// HostID..HostID+Size-1. Allocator hands out non-overlapping blocks and
// keeps them in one small file per host, so a restarted process, and
// every other driver on the host, sees every block still in use. NewNamespace
// creates such a namespace, owned by the block's base UID, and
// MountIDMapped shows a filesystem owned by container IDs (a template's
// files, owned by 0..65535 on disk) to it as its own, without rewriting a
// single inode.
package userns

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"

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
	// DefaultCount blocks of Size end at host ID 1879048191, the top of
	// that range. One holds the VM runtime's uids (VMUIDBase); the
	// others, one per runc sandbox, bound how many a host runs (12,287).
	DefaultCount = 12288

	// VMUIDBase and VMUIDCount are the host IDs the VM runtime runs its
	// QEMUs as, one each (internal/runtime/vm): inside the blocks' span,
	// so no block that overlaps them is handed out.
	VMUIDBase  uint32 = 0x54000000 // 1409286144
	VMUIDCount uint32 = 65536
)

// Range is one sandbox's block: container ID 0 is host ID HostID.
type Range struct {
	HostID uint32 `json:"host_id"`
	Size   uint32 `json:"size"`
}

// Contains reports whether host ID id lies in r.
func (r Range) Contains(id uint32) bool { return id >= r.HostID && id-r.HostID < r.Size }

func (r Range) overlaps(o Range) bool {
	return uint64(r.HostID) < o.end() && uint64(o.HostID) < r.end()
}

// end is one past r's last host ID.
func (r Range) end() uint64 { return uint64(r.HostID) + uint64(r.Size) }

// Allocator hands out Ranges by sandbox ID within a scope (a runc root:
// sandbox IDs are unique only within one). Its state is one JSON file
// per host, guarded by an flock on a lock file next to it, so
// allocations are atomic across goroutines and processes, survive
// restarts, and never overlap between two drivers on one host.
type Allocator struct {
	file, lock string
	scope      string
	first      uint32
	count      int

	// last is the file's content as this allocator last read or wrote
	// it, and what it parsed to: a read that finds the same bytes skips
	// the JSON decoding, most of an Acquire's time with thousands of
	// sandboxes up.
	lastMu sync.Mutex
	last   []byte
	parsed hostState
}

// DefaultFile is the host's allocation file. It is on /run: allocations
// outlive a daemon restart and go, with the sandboxes, at reboot.
const DefaultFile = "/run/cube/userns.json"

// NewAllocator keeps its state in file (DefaultFile when empty) and
// file+".lock", and hands out count blocks of Size starting at host ID
// first to the sandboxes of scope. scope is an absolute directory that
// exists while its sandboxes may: blocks of a scope whose directory is
// gone are free again.
func NewAllocator(file, scope string, first uint32, count int) (*Allocator, error) {
	if file == "" {
		file = DefaultFile
	}
	if first == 0 {
		first = DefaultFirst
	}
	if count <= 0 {
		count = DefaultCount
	}
	if first < Size || uint64(first)+uint64(count)*Size > 1<<32-1 {
		return nil, fmt.Errorf("userns: %d blocks from host ID %d do not fit between 65536 and 2^32-2: %w", count, first, errdefs.ErrInvalidArgument)
	}
	if !filepath.IsAbs(scope) {
		return nil, fmt.Errorf("userns: scope %q is not an absolute directory: %w", scope, errdefs.ErrInvalidArgument)
	}
	if err := os.MkdirAll(filepath.Dir(file), 0o700); err != nil {
		return nil, fmt.Errorf("userns: %w", err)
	}
	return &Allocator{
		file:  file,
		lock:  file + ".lock",
		scope: filepath.Clean(scope),
		first: first,
		count: count,
	}, nil
}

// Import moves the allocations kept in old (a per-scope file of the
// earlier layout: a JSON object of ranges by sandbox ID) into a's scope
// and removes old. A missing old is nothing to do.
func (a *Allocator) Import(old string) error {
	b, err := os.ReadFile(old)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("userns: %w", err)
	}
	var m map[string]Range
	if err := json.Unmarshal(b, &m); err != nil {
		return fmt.Errorf("userns: %s: %w: %w", old, errdefs.ErrInternal, err)
	}
	err = a.update(func(all hostState) (changed bool, err error) {
		mine := all.scope(a.scope)
		for id, r := range m {
			if _, ok := mine[id]; !ok {
				mine[id], changed = r, true
			}
		}
		return changed, nil
	})
	if err != nil {
		return err
	}
	return os.Remove(old)
}

// hostState is the file's content: ranges by sandbox ID by scope.
type hostState map[string]map[string]Range

func (h hostState) clone() hostState {
	c := make(hostState, len(h))
	for s, m := range h {
		c[s] = maps.Clone(m)
	}
	return c
}

func (h hostState) scope(s string) map[string]Range {
	m, ok := h[s]
	if !ok {
		m = map[string]Range{}
		h[s] = m
	}
	return m
}

// taken returns every range in use on the host, in every scope, and the
// VM runtime's uids, sorted for checking blocks against by binary search
// (a node runs thousands of sandboxes, and every create looks for one).
func (h hostState) taken() taken {
	t := taken{ranges: []Range{{HostID: VMUIDBase, Size: VMUIDCount}}}
	for _, m := range h {
		for _, r := range m {
			t.ranges = append(t.ranges, r)
		}
	}
	slices.SortFunc(t.ranges, func(a, b Range) int { return cmp.Compare(a.HostID, b.HostID) })
	t.maxEnd = make([]uint64, len(t.ranges))
	var end uint64
	for i, r := range t.ranges {
		end = max(end, r.end())
		t.maxEnd[i] = end
	}
	return t
}

// taken is a set of ranges sorted by HostID, with the highest end of each
// prefix: the ranges need not be disjoint or of one size (an imported or
// hand-edited file).
type taken struct {
	ranges []Range
	maxEnd []uint64
}

// overlaps reports whether r overlaps any range of t. The ranges that
// start before r ends are a prefix; one of them overlaps r if and only if
// the highest end among them lies past r's start.
func (t taken) overlaps(r Range) bool {
	i, _ := slices.BinarySearchFunc(t.ranges, r.end(), func(o Range, end uint64) int {
		return cmp.Compare(uint64(o.HostID), end)
	})
	return i > 0 && t.maxEnd[i-1] > uint64(r.HostID)
}

// Acquire returns id's range, allocating a free block when id has none
// yet (so a retried start reuses its block): the first free one of
// prefer (blocks by host ID that the caller has something ready for),
// else the lowest.
func (a *Allocator) Acquire(id string, prefer ...uint32) (Range, error) {
	var got Range
	err := a.update(func(all hostState) (bool, error) {
		m := all.scope(a.scope)
		if r, ok := m[id]; ok {
			got = r
			return false, nil
		}
		t := all.taken()
		for _, h := range prefer {
			r := Range{HostID: h, Size: Size}
			if a.inBounds(r) && !t.overlaps(r) {
				m[id], got = r, r
				return true, nil
			}
		}
		for i := range a.count {
			r := Range{HostID: a.first + uint32(i)*Size, Size: Size}
			if !t.overlaps(r) {
				m[id], got = r, r
				return true, nil
			}
		}
		return false, fmt.Errorf("userns: all %d ID ranges are in use: %w", a.count, errdefs.ErrResourceExhausted)
	})
	return got, err
}

// Free returns up to n free blocks, lowest first.
func (a *Allocator) Free(n int) ([]Range, error) {
	var all hostState
	err := a.locked(unix.LOCK_SH, func() (err error) {
		all, err = a.read()
		return err
	})
	if err != nil {
		return nil, err
	}
	var out []Range
	t := all.taken()
	for i := 0; i < a.count && len(out) < n; i++ {
		r := Range{HostID: a.first + uint32(i)*Size, Size: Size}
		if !t.overlaps(r) {
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
	return a.update(func(all hostState) (bool, error) {
		_, ok := all[a.scope][id]
		delete(all[a.scope], id)
		return ok, nil
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

// All returns every allocation of a's scope.
func (a *Allocator) All() (map[string]Range, error) {
	var out map[string]Range
	err := a.locked(unix.LOCK_SH, func() error {
		all, err := a.read()
		out = all.scope(a.scope)
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

// update runs fn on the host's allocations, under the lock, and writes
// them back if fn changed them.
func (a *Allocator) update(fn func(hostState) (changed bool, err error)) error {
	return a.locked(unix.LOCK_EX, func() error {
		all, err := a.read()
		if err != nil {
			return err
		}
		changed, err := fn(all)
		if err != nil {
			return err
		}
		if !changed {
			// Nothing changed (releasing an ID that has no range, as an
			// undo after a failed Acquire does): no write, so it cannot
			// fail on a full run dir.
			return nil
		}
		for s, m := range all {
			if len(m) == 0 {
				delete(all, s)
			}
		}
		b, err := json.Marshal(all)
		if err != nil {
			return err
		}
		// Written aside and renamed: a crash mid-write never leaves a
		// truncated file that would forget every allocation.
		tmp := a.file + ".tmp"
		if err := os.WriteFile(tmp, b, 0o600); err != nil {
			_ = os.Remove(tmp)
			if errors.Is(err, unix.ENOSPC) && len(b) <= a.size() {
				// A full filesystem: a release (the file shrinks) still
				// goes through by overwriting the file's own blocks.
				return a.overwrite(b)
			}
			return fmt.Errorf("userns: %w", err)
		}
		if err := os.Rename(tmp, a.file); err != nil {
			_ = os.Remove(tmp)
			return fmt.Errorf("userns: %w", err)
		}
		a.remember(b, all)
		return nil
	})
}

// size is the allocation file's length (0 when absent).
func (a *Allocator) size() int {
	st, err := os.Stat(a.file)
	if err != nil {
		return 0
	}
	return int(st.Size())
}

// overwrite writes b over the file in place, padded with spaces (valid
// JSON) to the file's length, so it needs no new block. One write of a
// few KiB within blocks the file owns: a crash cannot leave it half old,
// half new beyond what a torn page would, and the run dir holding it is a
// tmpfs that a crash empties anyway.
func (a *Allocator) overwrite(b []byte) error {
	n := a.size()
	padded := bytes.Repeat([]byte(" "), n)
	copy(padded, b)
	f, err := os.OpenFile(a.file, os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("userns: %w", err)
	}
	defer f.Close()
	if _, err := f.WriteAt(padded, 0); err != nil {
		return fmt.Errorf("userns: overwrite in place: %w", err)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("userns: %w", err)
	}
	return nil
}

// parse reads and decodes the file (an absent file is no allocations).
func (a *Allocator) parse() (hostState, error) {
	b, err := os.ReadFile(a.file)
	if errors.Is(err, os.ErrNotExist) {
		return hostState{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("userns: %w", err)
	}
	a.lastMu.Lock()
	defer a.lastMu.Unlock()
	if a.parsed != nil && bytes.Equal(b, a.last) {
		return a.parsed.clone(), nil
	}
	all := hostState{}
	if err := json.Unmarshal(b, &all); err != nil {
		return nil, fmt.Errorf("userns: %s: %w: %w", a.file, errdefs.ErrInternal, err)
	}
	a.last, a.parsed = b, all.clone()
	return all, nil
}

// remember records that the file now holds b, which is all.
func (a *Allocator) remember(b []byte, all hostState) {
	a.lastMu.Lock()
	defer a.lastMu.Unlock()
	a.last, a.parsed = b, all.clone()
}

// read returns the host's allocations, less those of scopes whose
// directory is gone (a test harness's removed root, a driver moved
// elsewhere) and under whose IDs no process runs.
func (a *Allocator) read() (hostState, error) {
	all, err := a.parse()
	if err != nil {
		return nil, err
	}
	for s := range all {
		if s == a.scope {
			continue
		}
		if _, err := os.Stat(s); errors.Is(err, os.ErrNotExist) && !runsAny(all[s]) {
			delete(all, s)
		}
	}
	return all, nil
}

// runsAny reports whether a process on the host runs under an ID of one
// of ranges (its real, effective, saved or filesystem uid): a root
// directory that is missing (a mount not up yet) does not free the
// blocks of sandboxes still running, which a new sandbox would otherwise
// share. Unreadable /proc counts as in use.
func runsAny(ranges map[string]Range) bool {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return true
	}
	for _, e := range ents {
		if e.Name()[0] < '0' || e.Name()[0] > '9' {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/status")
		if err != nil {
			continue // gone meanwhile
		}
		for _, line := range strings.Split(string(b), "\n") {
			rest, ok := strings.CutPrefix(line, "Uid:")
			if !ok {
				continue
			}
			for _, f := range strings.Fields(rest) {
				id, err := strconv.ParseUint(f, 10, 32)
				if err != nil {
					continue
				}
				for _, r := range ranges {
					if r.Contains(uint32(id)) {
						return true
					}
				}
			}
			break
		}
	}
	return false
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
