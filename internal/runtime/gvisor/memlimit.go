package gvisor

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/cubesandbox/cube/internal/runtime/cgroups"
)

// saveHeadroom is how far above its memory limit a sandbox's cgroup may
// go while the sentry saves it (liftMemoryLimit).
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

// limitFile is one memory limit of a cgroup: its file and what it held.
type limitFile struct {
	path, old string
}

// liftMemoryLimit raises every memory limit of cgroupPath (cgroup v1's
// memory.memsw.limit_in_bytes and memory.limit_in_bytes, v2's memory.max)
// by `by` bytes and returns what puts them back. A cgroup found nowhere,
// or without a limit, is left alone. v1 refuses a memory limit above the
// memory+swap one, so memsw goes up first and comes down last.
func liftMemoryLimit(cgroupPath string, by int64) (lowered func() error, err error) {
	dirs, err := cgroups.Dirs(cgroupPath)
	if err != nil {
		return nil, err
	}
	var lifted []limitFile
	lower := func() error {
		var errs []error
		for i := len(lifted) - 1; i >= 0; i-- {
			if err := os.WriteFile(lifted[i].path, []byte(lifted[i].old), 0); err != nil {
				errs = append(errs, fmt.Errorf("put back %s: %w", lifted[i].path, err))
			}
		}
		return errors.Join(errs...)
	}
	for _, d := range dirs {
		for _, name := range []string{"memory.memsw.limit_in_bytes", "memory.limit_in_bytes", "memory.max"} {
			p := filepath.Join(d, name)
			b, err := os.ReadFile(p)
			if errors.Is(err, os.ErrNotExist) {
				continue
			}
			if err != nil {
				return nil, errors.Join(err, lower())
			}
			old := strings.TrimSpace(string(b))
			n, err := strconv.ParseInt(old, 10, 64)
			if err != nil || n >= unlimited {
				continue // "max", or no limit
			}
			if err := os.WriteFile(p, []byte(strconv.FormatInt(n+by, 10)), 0); err != nil {
				return nil, errors.Join(fmt.Errorf("lift %s: %w", p, err), lower())
			}
			lifted = append(lifted, limitFile{p, old})
		}
	}
	return lower, nil
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
// the returned lower puts the spec's limits on it once the restore is
// done. config.json keeps the spec's limits throughout. Without a cgroup
// v1 memory hierarchy (a pure cgroup2 host), or when the directory
// exists already, nothing is done and lower is a no-op.
func restoreRoom(cgroupPath string, limit, swap *int64, by int64) (lower func() error, err error) {
	nop := func() error { return nil }
	if cgroupPath == "" || limit == nil || *limit <= 0 {
		return nop, nil
	}
	mounts, err := cgroups.Mounts()
	if err != nil {
		return nop, err
	}
	dir := ""
	for _, m := range mounts {
		if _, err := os.Stat(filepath.Join(m, "memory.limit_in_bytes")); err == nil {
			dir = filepath.Join(m, cgroupPath)
			break
		}
	}
	if dir == "" {
		return nop, nil
	}
	if _, err := os.Stat(dir); err == nil {
		return nop, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nop, err
	}
	// A new cgroup has no limit: memory first, then memory+swap (which
	// may not be below it).
	set := func(name string, v int64) error {
		return os.WriteFile(filepath.Join(dir, name), []byte(strconv.FormatInt(v, 10)), 0)
	}
	if err := set("memory.limit_in_bytes", *limit+by); err != nil {
		return nop, errors.Join(err, os.Remove(dir))
	}
	hasSwap := swap != nil && *swap >= *limit
	if _, err := os.Stat(filepath.Join(dir, "memory.memsw.limit_in_bytes")); err != nil {
		hasSwap = false // swap accounting off
	}
	if hasSwap {
		if err := set("memory.memsw.limit_in_bytes", *swap+by); err != nil {
			return nop, errors.Join(err, os.Remove(dir))
		}
	}
	return func() error {
		// Down to the spec's limits: memory first (memory+swap may not
		// go below it). The kernel reclaims what it can (the image's
		// page cache) and answers EBUSY while the sandbox holds more;
		// retried for a while, as the sentry returns the restore's
		// buffers to the host.
		deadline := time.Now().Add(3 * time.Second)
		for {
			err := set("memory.limit_in_bytes", *limit)
			if err == nil && hasSwap {
				err = set("memory.memsw.limit_in_bytes", *swap)
			}
			if err == nil || time.Now().After(deadline) {
				return err
			}
			time.Sleep(50 * time.Millisecond)
		}
	}, nil
}
