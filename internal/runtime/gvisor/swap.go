package gvisor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"time"

	gorunc "github.com/containerd/go-runc"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/cgroups"
)

// A restore in place without `runsc delete` on its path (slots.go says
// why two runsc IDs). The checkpointed sandbox is retired: its processes
// get SIGKILL (not waited for) and its state file is rewritten to say
// stopped, with no PIDs and no cgroup; the restored copy starts in the
// other slot on the same bundle, cgroup and network namespace; runsc's
// delete of the retired slot runs in the background. runsc deletes what it
// would anyway (its state and lock files) and nothing else: with no PIDs
// it signals nothing, and with no cgroup it does not try to remove the
// cgroup the restored copy runs in (it would retry that for 5 s and fail).

// reapBound caps one background `runsc delete` of a retired slot.
const reapBound = time.Minute

// FailpointReap fires in the background reap of a retired slot, before
// runsc's delete: an error leaves the retired slot for Stop, the next
// swap or ReapRetired.
const FailpointReap = "gvisor/reap"

// restoreSwap restores sandbox id from the image in dir into the slot cur
// does not hold, retiring cur (killed if still running). The other slot is
// reaped first: whether or not its state file is still there, a background
// reap of it may still be running (runsc's delete removes the state file
// before it returns), and nothing may launch into that slot until it ends.
func (d *Driver) restoreSwap(ctx context.Context, id, bundle, cur, dir string) (runtime.State, error) {
	spec, err := readSpec(bundle)
	if err != nil {
		return runtime.State{}, fmt.Errorf("gvisor restore %s in place: %w", id, err)
	}
	if _, err := os.Stat(filepath.Join(dir, CheckpointFile)); err != nil {
		return runtime.State{}, fmt.Errorf("gvisor restore %s: no memory image in %s: %w", id, dir, errdefs.ErrNotFound)
	}
	target := otherSlot(id, cur)
	if err := d.reap(ctx, id, target); err != nil {
		return runtime.State{}, err
	}
	if err := d.retire(ctx, id, cur, spec); err != nil {
		return runtime.State{}, err
	}
	// runsc took the namespace's addresses into the old sandbox's netstack;
	// the restored one reads them from the namespace at start.
	if err := restoreNet(spec, bundle); err != nil {
		return runtime.State{}, fmt.Errorf("gvisor restore %s in place: %w", id, err)
	}
	if err := failpoint.Eval(ctx, FailpointRestoreStopped); err != nil {
		return runtime.State{}, err
	}
	st, err := d.launchAs(ctx, id, target, bundle, spec, dir)
	if err != nil {
		return runtime.State{}, err
	}
	d.reapInBackground(id, cur)
	return st, nil
}

// retire stops slot rid of sandbox id for good without waiting: SIGKILL to
// every process in the sandbox's cgroup (no other slot runs there yet),
// whose pidfds the next launch into rid waits on (awaitExit), then its
// state file says stopped with no PIDs and no cgroup.
func (d *Driver) retire(ctx context.Context, id, rid string, spec *specs.Spec) error {
	if spec.Linux != nil && spec.Linux.CgroupsPath != "" {
		fds := killPidfds(spec.Linux.CgroupsPath)
		if len(fds) > 0 {
			d.log.DebugContext(ctx, "retired slot: killed the cgroup's processes", "id", id, "slot", rid, "processes", len(fds))
		}
		d.keepDying(rid, fds)
	}
	if err := d.retireState(rid); err != nil {
		return fmt.Errorf("gvisor retire %s: %w", rid, err)
	}
	return nil
}

// retireState rewrites runsc's state file of slot rid: status stopped, no
// sandbox or gofer PID (runsc SIGKILLs recorded PIDs unchecked; these are
// dead and soon reused), and no cgroup (runsc would try to remove the
// cgroup, which the sandbox's other slot may run in). A missing file is
// no error.
func (d *Driver) retireState(rid string) error {
	return d.editState(rid, func(st map[string]json.RawMessage, sb map[string]json.RawMessage) {
		st["status"] = json.RawMessage(`"stopped"`)
		if sb != nil {
			sb["cgroup"] = json.RawMessage("null")
		}
	})
}

// editState rewrites runsc's state file of slot rid with both PIDs zeroed,
// after edit (which may be nil) changed the top level and the "sandbox"
// object (nil when the state has none).
func (d *Driver) editState(rid string, edit func(st, sb map[string]json.RawMessage)) error {
	path := d.statePath(rid)
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var st map[string]json.RawMessage
	if err := json.Unmarshal(b, &st); err != nil {
		return fmt.Errorf("runsc state %s: %w", path, err)
	}
	st["goferPid"] = json.RawMessage("0")
	var sb map[string]json.RawMessage
	if raw, ok := st["sandbox"]; ok && string(raw) != "null" {
		if err := json.Unmarshal(raw, &sb); err != nil {
			return fmt.Errorf("runsc state %s: sandbox: %w", path, err)
		}
		sb["pid"] = json.RawMessage("0")
	}
	if edit != nil {
		edit(st, sb)
	}
	if sb != nil {
		if st["sandbox"], err = json.Marshal(sb); err != nil {
			return err
		}
	}
	out, err := json.Marshal(st)
	if err != nil {
		return err
	}
	tmp := path + ".cube-tmp"
	if err := os.WriteFile(tmp, out, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// reapInBackground deletes retired slot rid of sandbox id with runsc,
// outside the caller's path. Stop and the next swap wait for it (reap).
func (d *Driver) reapInBackground(id, rid string) {
	done := make(chan struct{})
	d.reapMu.Lock()
	if d.reaps == nil {
		d.reaps = map[string]chan struct{}{}
	}
	d.reaps[rid] = done
	d.reapMu.Unlock()
	go func() {
		defer func() {
			d.reapMu.Lock()
			delete(d.reaps, rid)
			d.reapMu.Unlock()
			close(done)
		}()
		ctx, cancel := context.WithTimeout(context.Background(), reapBound)
		defer cancel()
		if err := failpoint.Eval(ctx, FailpointReap); err != nil {
			d.log.WarnContext(ctx, "reap of a retired slot failed; left for the next stop, swap or start", "id", id, "slot", rid, "error", err)
			return
		}
		if err := d.deleteRetired(ctx, id, rid); err != nil {
			d.log.WarnContext(ctx, "reap of a retired slot failed; left for the next stop, swap or start", "id", id, "slot", rid, "error", err)
		}
	}()
}

// reap deletes retired slot rid of sandbox id now, after a background reap
// of it in flight has finished. A slot with no state file and no reap in
// flight is no error.
func (d *Driver) reap(ctx context.Context, id, rid string) error {
	if err := d.awaitReap(ctx, rid); err != nil {
		return err
	}
	return d.deleteRetired(ctx, id, rid)
}

// awaitReap waits until no background reap of slot rid is in flight.
func (d *Driver) awaitReap(ctx context.Context, rid string) error {
	d.reapMu.Lock()
	done := d.reaps[rid]
	d.reapMu.Unlock()
	if done == nil {
		return nil
	}
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("gvisor reap %s: %w", rid, ctx.Err())
	}
}

// deleteRetired runs runsc's delete on retired slot rid, whose state file
// is rewritten first (again: a crash may have come between the kill and
// the rewrite; both are idempotent). A slot already gone is no error.
func (d *Driver) deleteRetired(ctx context.Context, id, rid string) error {
	if err := d.retireState(rid); err != nil {
		return fmt.Errorf("gvisor reap %s: %w", rid, err)
	}
	if _, err := os.Stat(d.statePath(rid)); err == nil {
		if err := d.rsc("none", "").Delete(ctx, rid, &gorunc.DeleteOpts{Force: true}); err != nil {
			if err := d.classify(ctx, "delete retired slot", id, err, ""); !errdefs.IsNotFound(err) {
				return err
			}
		}
	}
	if err := d.dropStaleLock(ctx, rid); err != nil {
		return fmt.Errorf("gvisor reap %s: %w", rid, err)
	}
	return nil
}

// ReapRetired deletes every retired slot in runsc's root (one left by a
// background reap that failed, or by a cubelet that died during a swap).
// cubelet's reconcile calls it at start, before it lists sandboxes.
func (d *Driver) ReapRetired(ctx context.Context) error {
	all, err := d.slotsInRoot()
	if err != nil {
		return fmt.Errorf("gvisor reap: %w", err)
	}
	var errs []error
	for id, rids := range all {
		if len(rids) < 2 {
			continue
		}
		_, _, retired, err := d.lookup(ctx, id)
		if err != nil || retired == "" {
			errs = append(errs, err)
			continue
		}
		if err := d.reap(ctx, id, retired); err != nil {
			errs = append(errs, err)
			continue
		}
		d.log.InfoContext(ctx, "reaped a retired slot", "id", id, "slot", retired)
	}
	return errors.Join(errs...)
}

// killOnce sends SIGKILL to every process in cgroupPath (all hierarchies)
// once, without waiting for them to exit, and says how many it signalled.
func killOnce(cgroupPath string) int {
	fds := killPidfds(cgroupPath)
	closeAll(fds)
	return len(fds)
}

// killPidfds sends SIGKILL once to every process in cgroupPath (all
// hierarchies), without waiting, through a pidfd, and returns the pidfds
// of the processes it signalled (the caller closes them; each becomes
// readable when its process has exited). A PID read from cgroup.procs may
// be another process's by the time it is opened: a pidfd is signalled
// only when, after it was opened, its PID is still in the cgroup, and the
// signal succeeds only while the opened process lives, so that process
// is the one the cgroup listed.
func killPidfds(cgroupPath string) []int {
	dirs, err := cgroups.Dirs(cgroupPath)
	if err != nil {
		return nil
	}
	var out []int
	for _, dir := range dirs {
		_ = filepath.WalkDir(dir, func(p string, e fs.DirEntry, werr error) error {
			if werr != nil || !e.IsDir() {
				return nil //nolint:nilerr // a cgroup removed under the walk holds nothing
			}
			procs := filepath.Join(p, "cgroup.procs")
			opened := map[int]int{} // pid -> pidfd
			for _, pid := range cgroups.ReadPIDs(procs) {
				fd, err := unix.PidfdOpen(pid, 0)
				if errors.Is(err, unix.ENOSYS) {
					// A kernel without pidfds (before 5.3): the
					// plain kill, nothing to wait on.
					_ = syscall.Kill(pid, syscall.SIGKILL)
					continue
				}
				if err == nil {
					opened[pid] = fd
				}
			}
			for _, pid := range cgroups.ReadPIDs(procs) {
				fd, ok := opened[pid]
				if !ok {
					continue
				}
				delete(opened, pid)
				if unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0) != nil {
					_ = unix.Close(fd) // gone already
					continue
				}
				out = append(out, fd)
			}
			for _, fd := range opened { // left the cgroup in between
				_ = unix.Close(fd)
			}
			return nil
		})
	}
	return out
}

func closeAll(fds []int) {
	for _, fd := range fds {
		_ = unix.Close(fd)
	}
}

// exitBound caps how long a launch into a slot waits for the processes of
// the sandbox last retired from it to exit.
const exitBound = 10 * time.Second

// keepDying records the pidfds of the processes killed when slot rid was
// retired: the next launch into rid waits for them (awaitExit).
func (d *Driver) keepDying(rid string, fds []int) {
	if len(fds) == 0 {
		return
	}
	d.reapMu.Lock()
	defer d.reapMu.Unlock()
	if d.dying == nil {
		d.dying = map[string][]int{}
	}
	d.dying[rid] = append(d.dying[rid], fds...)
}

// awaitExit waits, for up to exitBound, until the processes killed when
// slot rid was retired have exited, and closes their pidfds. Why: runsc
// names the sandbox's control socket after the slot
// (@runsc-sandbox.<rid>), and the old sandbox process holds it until it
// exits; a sentry with a large memory takes a while to exit after
// SIGKILL, and a restore into the slot before that fails. Nothing is
// recorded for a slot retired by a previous cubelet (ReapRetired, at
// start, runs long after).
func (d *Driver) awaitExit(ctx context.Context, rid string) error {
	d.reapMu.Lock()
	fds := d.dying[rid]
	delete(d.dying, rid)
	d.reapMu.Unlock()
	if len(fds) == 0 {
		return nil
	}
	defer closeAll(fds)
	begin := time.Now()
	deadline := begin.Add(exitBound)
	pending := fds
	for {
		pfds := make([]unix.PollFd, len(pending))
		for i, fd := range pending {
			pfds[i] = unix.PollFd{Fd: int32(fd), Events: unix.POLLIN}
		}
		// In short slices, so that ctx is heeded.
		if _, err := unix.Poll(pfds, 50); err != nil && !errors.Is(err, unix.EINTR) {
			return fmt.Errorf("gvisor: wait for the retired sandbox of %s to exit: %w", rid, err)
		}
		left := pending[:0]
		for i, p := range pfds {
			if p.Revents == 0 {
				left = append(left, pending[i])
			}
		}
		pending = left
		if len(pending) == 0 {
			if took := time.Since(begin); took > 100*time.Millisecond {
				d.log.DebugContext(ctx, "waited for a retired sandbox to exit", "slot", rid, "took", took)
			}
			return nil
		}
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("gvisor: wait for the retired sandbox of %s to exit: %w", rid, err)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("gvisor: %d processes of the sandbox retired from %s still there %s after SIGKILL: %w",
				len(pending), rid, exitBound, errdefs.ErrUnavailable)
		}
	}
}

// dropDying closes the pidfds kept for both slots of sandbox id (Stop: its
// cgroup's processes are dead, and no launch into its slots is pending).
func (d *Driver) dropDying(id string) {
	d.reapMu.Lock()
	defer d.reapMu.Unlock()
	for _, rid := range slotIDs(id) {
		closeAll(d.dying[rid])
		delete(d.dying, rid)
	}
}
