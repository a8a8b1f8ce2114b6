package gvisor

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/cubesandbox/cube/internal/runtime/cgroups"
)

// saveHeadroom is how far above its memory limit a sandbox's cgroup may
// go while the sentry saves or restores it (liftMemory, restoreRoom).
//
// Why: runsc puts the sentry, the gofer and the ptrace stubs in the
// sandbox's cgroup, so the limit bounds gVisor's own memory with the
// guest's, and a save needs memory of its own (the encoder's buffers and
// object table, the compressor's). A sandbox near its limit was killed
// by the kernel's OOM killer mid-save: runsc then fails with `urpc method
// "containerManager.Checkpoint" failed: EOF` and the sandbox is gone (a
// 64 MiB sandbox with ~40 MiB charged, every time). While the sentry
// saves, the guest's tasks are stopped, so the headroom serves the save;
// the sandbox stops when the save ends, and the restore starts it in a
// new cgroup with the spec's limit.
const saveHeadroom int64 = 128 << 20

// unlimited is where a cgroup v1 limit reads as "no limit" (the kernel
// reports PAGE_COUNTER_MAX pages, rounded down to the page size).
const unlimited int64 = 1 << 62

// How the spec's limit is put back after a save or a restore: retried
// for lowerWait in the caller, then every lowerEvery in the background
// for at most lowerBound (or until the sandbox is stopped, its cgroup is
// gone, or the next save lifts the limit again). Variables for the
// tests, which shorten them.
var (
	lowerWait  = 3 * time.Second
	lowerEvery = time.Second
	lowerBound = 10 * time.Minute
)

// memLimits are a sandbox's memory limits as its spec (config.json) sets
// them: what its cgroup is lifted from and put back to. They are never
// read from the cgroup, which may still hold an earlier lift.
type memLimits struct {
	limit int64 // memory, bytes
	swap  int64 // memory+swap, bytes; 0 when the spec sets none
}

// specMemory is the spec's memory limits; false when it sets none.
func specMemory(sp *specs.Spec) (memLimits, bool) {
	if sp == nil || sp.Linux == nil || sp.Linux.Resources == nil || sp.Linux.Resources.Memory == nil {
		return memLimits{}, false
	}
	m := sp.Linux.Resources.Memory
	if m.Limit == nil || *m.Limit <= 0 {
		return memLimits{}, false
	}
	ml := memLimits{limit: *m.Limit}
	if m.Swap != nil && *m.Swap >= *m.Limit {
		ml.swap = *m.Swap
	}
	return ml, true
}

// Counters of the headroom a sandbox kept (read by tests, and by
// MemoryHeadroomKept).
var (
	// headroomKept counts lowerings the kernel refused for lowerWait: the
	// sandbox held more than its spec's limit, so its cgroup kept part
	// of the headroom, with the spec's limit as v1's soft limit or v2's
	// memory.high, while the lowering went on in the background.
	headroomKept atomic.Int64
	// headroomGaveUp counts background lowerings that ended at
	// lowerBound without reaching the spec's limit.
	headroomGaveUp atomic.Int64
)

// MemoryHeadroomKept is how many times in this process a sandbox's cgroup
// could not be put back to its spec's memory limit right after a save or
// a restore, and how many of those gave up after lowerBound.
func MemoryHeadroomKept() (kept, gaveUp int64) { return headroomKept.Load(), headroomGaveUp.Load() }

// readLimit reads a cgroup memory limit file: ok is false when the file
// does not exist or holds no limit ("max", or v1's PAGE_COUNTER_MAX).
func readLimit(path string) (n int64, ok bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	n, err = strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil || n >= unlimited {
		return 0, false
	}
	return n, true
}

func writeInt(path string, v int64) error {
	return os.WriteFile(path, []byte(strconv.FormatInt(v, 10)), 0)
}

// setMemory puts every memory limit runsc set on cgroupPath (cgroup v1's
// memory.limit_in_bytes and memory.memsw.limit_in_bytes, v2's memory.max)
// at the spec's value plus extra: absolute values, so a lift from a
// cgroup that still holds an earlier lift goes no higher. A limit
// without a limit is left alone. v1 refuses a memory limit above the
// memory+swap one, so memsw goes first when the limits go up.
func setMemory(cgroupPath string, ml memLimits, extra int64) error {
	dirs, err := cgroups.Dirs(cgroupPath)
	if err != nil {
		return err
	}
	var errs []error
	for _, d := range dirs {
		mem := filepath.Join(d, "memory.limit_in_bytes")
		if cur, ok := readLimit(mem); ok {
			type lv struct {
				path string
				v    int64
			}
			order := []lv{{mem, ml.limit + extra}}
			sw := filepath.Join(d, "memory.memsw.limit_in_bytes")
			if _, ok := readLimit(sw); ok && ml.swap > 0 {
				if ml.limit+extra > cur {
					order = append([]lv{{sw, ml.swap + extra}}, order...)
				} else {
					order = append(order, lv{sw, ml.swap + extra})
				}
			}
			for _, f := range order {
				if err := writeInt(f.path, f.v); err != nil {
					errs = append(errs, fmt.Errorf("set %s: %w", f.path, err))
					break
				}
			}
		}
		if _, ok := readLimit(filepath.Join(d, "memory.max")); ok {
			// memory.high may hold the spec's limit from a lowering that
			// had to wait: it would throttle the save under the lift.
			_ = os.WriteFile(filepath.Join(d, "memory.high"), []byte("max"), 0)
			if err := writeInt(filepath.Join(d, "memory.max"), ml.limit+extra); err != nil {
				errs = append(errs, fmt.Errorf("set %s: %w", filepath.Join(d, "memory.max"), err))
			}
		}
	}
	return errors.Join(errs...)
}

// lowerOnce tries once to put cgroupPath's memory limits back to the
// spec's. done is true when they are there (or the cgroup is gone).
//
// When the kernel refuses (cgroup v1 answers EBUSY while the cgroup holds
// more than the new limit and cannot reclaim it), the spec's limit is
// enforced as far as the kernel lets it: v1's memory.soft_limit_in_bytes
// is set to it (reclaimed first under host memory pressure) and the hard
// limit is stepped halfway down towards it, which has the kernel reclaim
// what it can and leaves the sandbox less room to grow; v2 gets
// memory.high at the spec's limit (the kernel throttles and reclaims the
// cgroup above it). Once the spec's limit holds, the soft limit and
// memory.high are cleared (runsc sets neither).
func lowerOnce(cgroupPath string, ml memLimits) (done bool, err error) {
	dirs, err := cgroups.Dirs(cgroupPath)
	if err != nil {
		return false, err
	}
	done = true
	var errs []error
	for _, d := range dirs {
		mem := filepath.Join(d, "memory.limit_in_bytes")
		if _, ok := readLimit(mem); ok {
			werr := writeInt(mem, ml.limit)
			sw := filepath.Join(d, "memory.memsw.limit_in_bytes")
			if _, ok := readLimit(sw); werr == nil && ok && ml.swap > 0 {
				werr = writeInt(sw, ml.swap)
			}
			switch {
			case werr == nil:
				_ = os.WriteFile(filepath.Join(d, "memory.soft_limit_in_bytes"), []byte("-1"), 0)
			case errors.Is(werr, os.ErrNotExist):
				// The cgroup is gone with its sandbox.
			default:
				done = false
				errs = append(errs, fmt.Errorf("put back %s: %w", mem, werr))
				_ = writeInt(filepath.Join(d, "memory.soft_limit_in_bytes"), ml.limit)
				if cur, ok := readLimit(mem); ok && cur > ml.limit {
					// Halfway, page-aligned; memory+swap stays where it
					// is (never below memory).
					step := ml.limit + (cur-ml.limit)/2&^4095
					if step > ml.limit && step < cur {
						_ = writeInt(mem, step)
					}
				}
			}
		}
		if _, ok := readLimit(filepath.Join(d, "memory.max")); ok {
			high := filepath.Join(d, "memory.high")
			if err := writeInt(high, ml.limit); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, fmt.Errorf("set %s: %w", high, err))
			}
			werr := writeInt(filepath.Join(d, "memory.max"), ml.limit)
			switch {
			case werr == nil:
				_ = os.WriteFile(high, []byte("max"), 0)
			case errors.Is(werr, os.ErrNotExist):
			default:
				done = false
				errs = append(errs, fmt.Errorf("put back %s: %w", filepath.Join(d, "memory.max"), werr))
			}
		}
	}
	return done, errors.Join(errs...)
}

// liftMemory gives cgroupPath saveHeadroom (d.headroom) above the spec's
// limits for a save. A lowering still going on in the background for the
// cgroup is ended first, so it cannot take the room from the save. When
// the lift fails half-way the limits go back to the spec's.
func (d *Driver) liftMemory(cgroupPath string, ml memLimits) error {
	d.stopLowering(cgroupPath)
	if err := setMemory(cgroupPath, ml, d.headroom); err != nil {
		_, lerr := lowerOnce(cgroupPath, ml)
		return errors.Join(err, lerr)
	}
	return nil
}

// lowerer is a background lowering of one cgroup (lowerMemory).
type lowerer struct {
	cancel context.CancelFunc
	done   chan struct{}
}

// stopLowering ends the background lowering of cgroupPath, if any, and
// waits for it.
func (d *Driver) stopLowering(cgroupPath string) {
	if v, ok := d.lowerers.LoadAndDelete(cgroupPath); ok {
		l := v.(*lowerer)
		l.cancel()
		<-l.done
	}
}

// lowerMemory puts the spec's memory limits back on the cgroup of
// sandbox id after a save that left it running or after a restore.
//
// The kernel refuses a v1 limit below what the cgroup holds (EBUSY); a
// restored sentry holds more than the one that booted and returns the
// restore's buffers over a few seconds. So the lowering is retried for
// lowerWait here, and then, with the spec's limit enforced meanwhile as
// far as the kernel allows (lowerOnce), every lowerEvery in the
// background until it succeeds, the cgroup is gone, the sandbox is
// stopped or lifted again (stopLowering), or lowerBound passes. Each
// such case is logged and counted (MemoryHeadroomKept). Forcing the
// limit is not an option: v1 cannot, and v2 would OOM-kill the sandbox.
func (d *Driver) lowerMemory(ctx context.Context, id, cgroupPath string, ml memLimits) {
	deadline := time.Now().Add(lowerWait)
	for {
		done, err := lowerOnce(cgroupPath, ml)
		if done {
			return
		}
		if time.Now().After(deadline) {
			headroomKept.Add(1)
			d.log.WarnContext(ctx, "sandbox holds more memory than its limit; its cgroup keeps part of the headroom, with the limit as soft limit (v1) or memory.high (v2), and the limit is retried in the background",
				"id", id, "limit_bytes", ml.limit, "headroom_bytes", d.headroom, "retry_for", lowerBound, "error", err)
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	d.stopLowering(cgroupPath)
	bctx, cancel := context.WithTimeout(context.Background(), lowerBound)
	l := &lowerer{cancel: cancel, done: make(chan struct{})}
	d.lowerers.Store(cgroupPath, l)
	go func() {
		defer close(l.done)
		defer cancel()
		t := time.NewTicker(lowerEvery)
		defer t.Stop()
		for {
			select {
			case <-bctx.Done():
				if errors.Is(bctx.Err(), context.DeadlineExceeded) {
					headroomGaveUp.Add(1)
					d.log.Warn("gave up putting the sandbox's memory limit back; the soft limit (v1) or memory.high (v2) stays at it",
						"id", id, "limit_bytes", ml.limit, "tried_for", lowerBound)
					d.lowerers.CompareAndDelete(cgroupPath, l)
				}
				return
			case <-t.C:
			}
			done, err := lowerOnce(cgroupPath, ml)
			if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ENOENT) {
				done = true
			}
			if done {
				d.log.Info("sandbox's memory limit is back at its spec's", "id", id, "limit_bytes", ml.limit)
				d.lowerers.CompareAndDelete(cgroupPath, l)
				return
			}
		}
	}()
}

// restoreRoom gives a restore the same room above the memory limit as a
// save (saveHeadroom): a restore decodes the image in the sentry, whose
// memory is charged with the guest's, and a sandbox that ran near its
// limit was OOM-killed while being restored into it (runsc: `urpc method
// "containerManager.Restore" failed: EOF`).
//
// runsc applies the spec's limits when it creates the cgroup, before the
// sentry loads the image, but uses a controller's cgroup that already
// exists as it is ("Using pre-created cgroup"): the sandbox's cgroup v1
// memory directory is therefore made here with the limits raised, and
// the caller puts the spec's limits on it once the restore is done
// (lowerMemory). config.json keeps the spec's limits throughout. It
// returns the directory it made, which the caller removes when the
// launch fails; "" (nothing made) without a cgroup v1 memory hierarchy
// (a pure cgroup2 host), or when the directory exists already.
func restoreRoom(cgroupPath string, ml memLimits, by int64) (made string, err error) {
	if cgroupPath == "" || ml.limit <= 0 {
		return "", nil
	}
	mounts, err := cgroups.Mounts()
	if err != nil {
		return "", err
	}
	dir := ""
	for _, m := range mounts {
		if _, err := os.Stat(filepath.Join(m, "memory.limit_in_bytes")); err == nil {
			dir = filepath.Join(m, cgroupPath)
			break
		}
	}
	if dir == "" {
		return "", nil
	}
	if _, err := os.Stat(dir); err == nil {
		return "", nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	// A new cgroup has no limit: memory first, then memory+swap (which
	// may not be below it).
	if err := writeInt(filepath.Join(dir, "memory.limit_in_bytes"), ml.limit+by); err != nil {
		return "", errors.Join(err, os.Remove(dir))
	}
	if _, err := os.Stat(filepath.Join(dir, "memory.memsw.limit_in_bytes")); err == nil && ml.swap > 0 {
		if err := writeInt(filepath.Join(dir, "memory.memsw.limit_in_bytes"), ml.swap+by); err != nil {
			return "", errors.Join(err, os.Remove(dir))
		}
	}
	return dir, nil
}
