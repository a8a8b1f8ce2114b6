package gvisor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	gorunc "github.com/containerd/go-runc"
	specs "github.com/opencontainers/runtime-spec/specs-go"

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
// then its state file says stopped with no PIDs and no cgroup.
func (d *Driver) retire(ctx context.Context, id, rid string, spec *specs.Spec) error {
	if spec.Linux != nil && spec.Linux.CgroupsPath != "" {
		cg := spec.Linux.CgroupsPath
		if n := killOnce(cg); n > 0 {
			d.log.DebugContext(ctx, "retired slot: killed the cgroup's processes", "id", id, "slot", rid, "processes", n)
		}
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
	if _, err := os.Stat(d.statePath(rid)); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err := d.rsc("none", "").Delete(ctx, rid, &gorunc.DeleteOpts{Force: true}); err != nil {
		if err := d.classify(ctx, "delete retired slot", id, err, ""); !errdefs.IsNotFound(err) {
			return err
		}
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
	dirs, err := cgroups.Dirs(cgroupPath)
	if err != nil {
		return 0
	}
	n := 0
	for _, dir := range dirs {
		_ = filepath.WalkDir(dir, func(p string, e fs.DirEntry, werr error) error {
			if werr != nil || !e.IsDir() {
				return nil //nolint:nilerr // a cgroup removed under the walk holds nothing
			}
			b, err := os.ReadFile(filepath.Join(p, "cgroup.procs"))
			if err != nil {
				return nil //nolint:nilerr // as above
			}
			for _, f := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(f); err == nil && pid > 0 && syscall.Kill(pid, syscall.SIGKILL) == nil {
					n++
				}
			}
			return nil
		})
	}
	return n
}
