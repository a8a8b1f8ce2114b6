package gvisor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"

	gorunc "github.com/containerd/go-runc"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime/procstate"
)

// runscState is the part of runsc's per-container state file that
// `runsc state` reports.
type runscState struct {
	ID        string    `json:"id"`
	BundleDir string    `json:"bundleDir"`
	CreatedAt time.Time `json:"createdAt"`
	Status    string    `json:"status"`
	Sandbox   *struct {
		PID               int    `json:"pid"`
		ControlSocketPath string `json:"controlSocketPath"`
	} `json:"sandbox"`
	Spec *struct {
		Linux *struct {
			CgroupsPath string `json:"cgroupsPath"`
		} `json:"linux"`
	} `json:"spec"`
}

// errStateFormat means the state file is not in the layout readState
// knows; the caller asks runsc instead.
var errStateFormat = errors.New("unknown runsc state file layout")

// statePath is runsc's state file of the root container whose runsc ID
// is rid (a slot of a sandbox: slots.go).
func (d *Driver) statePath(rid string) string {
	return filepath.Join(d.root, rid+"_sandbox:"+rid+".state")
}

// lockPath is runsc's lock file of slot rid, which it holds exclusively
// while it rewrites or removes the state file.
func (d *Driver) lockPath(rid string) string {
	return filepath.Join(d.root, rid+"_sandbox:"+rid+".lock")
}

// readState answers what `runsc state` would, from runsc's state file.
//
// Why: every verb needs the sandbox's state, and `runsc state` is an exec
// of a large Go binary (about 25 ms here, more under load); a snapshot
// that keeps the sandbox running asks about six times. runsc itself
// computes the answer from this file: the recorded status, except that a
// running or created sandbox whose process is gone is stopped. The file
// is read under a shared lock on runsc's lock file, which runsc holds
// exclusively while it rewrites the file. TestStateFileMatchesRunsc
// checks the answers against runsc's own in every state.
func (d *Driver) readState(ctx context.Context, id, rid string) (*gorunc.Container, error) {
	path := d.statePath(rid)
	unlock, err := lockShared(ctx, d.lockPath(rid))
	if errors.Is(err, os.ErrNotExist) {
		if _, serr := os.Stat(path); serr == nil {
			return nil, errStateFormat // a state file without its lock file
		}
		return nil, fmt.Errorf("gvisor state %s: container %q does not exist: %w", id, rid, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("gvisor state %s: %w", id, err)
	}
	b, err := os.ReadFile(path)
	unlock()
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("gvisor state %s: container %q does not exist: %w", id, rid, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("gvisor state %s: %w", id, err)
	}
	var st runscState
	if err := json.Unmarshal(b, &st); err != nil || st.Status == "" || st.BundleDir == "" || st.ID != rid {
		return nil, errStateFormat
	}
	pid, cgroup := 0, ""
	if st.Sandbox != nil {
		pid = st.Sandbox.PID
	}
	if st.Spec != nil && st.Spec.Linux != nil {
		cgroup = st.Spec.Linux.CgroupsPath
	}
	if st.Status == "running" || st.Status == "created" {
		live, err := procstate.Alive(pid, cgroup)
		if err != nil {
			return nil, errStateFormat
		}
		if !live {
			st.Status = "stopped"
		}
	}
	if st.Status != "running" && st.Status != "created" && st.Status != "paused" {
		pid = -1 // what runsc reports for a sandbox that has no process
	}
	return &gorunc.Container{ID: id, Pid: pid, Status: st.Status, Bundle: st.BundleDir, Created: st.CreatedAt}, nil
}

// lockShared takes a shared flock on path, polling so that ctx can end
// the wait (runsc holds the lock exclusively for as long as a verb runs).
func lockShared(ctx context.Context, path string) (func(), error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	if err := flockWait(ctx, f, syscall.LOCK_SH); err != nil {
		f.Close()
		return nil, err
	}
	return func() { f.Close() }, nil // closing drops the lock
}

// flockWait takes flock how (LOCK_SH or LOCK_EX) on f, polling until ctx
// ends.
func flockWait(ctx context.Context, f *os.File, how int) error {
	for {
		err := syscall.Flock(int(f.Fd()), how|syscall.LOCK_NB)
		if err == nil {
			return nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) && !errors.Is(err, syscall.EINTR) {
			return fmt.Errorf("lock %s: %w", f.Name(), err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// dropStaleLock removes slot rid's lock file when the slot has no state
// file. runsc's delete removes both, but any runsc verb that loaded the
// slot while it was being deleted creates the lock file again (it opens
// it with O_CREAT before it finds the state gone), and nothing would ever
// remove it. It is removed under its exclusive lock, as runsc's delete
// does, so a runsc creating the slot, which holds the lock until it has
// written the state, is not cut off once it holds it. (runsc creates the
// file a moment before it locks it; callers run where no launch into
// the slot can be under way: Stop, a reap, which the driver orders
// before any launch into that slot.)
func (d *Driver) dropStaleLock(ctx context.Context, rid string) error {
	path := d.lockPath(rid)
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer f.Close()
	if err := flockWait(ctx, f, syscall.LOCK_EX); err != nil {
		return err
	}
	if _, err := os.Stat(d.statePath(rid)); !errors.Is(err, os.ErrNotExist) {
		return err // the slot exists (nil) or cannot be told
	}
	// The file locked must still be the one at path: another runsc may
	// have removed it and created a new one meanwhile.
	var held, now syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &held); err != nil {
		return err
	}
	if err := syscall.Stat(path, &now); err != nil || held.Ino != now.Ino || held.Dev != now.Dev {
		return nil
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}
