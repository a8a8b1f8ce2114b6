package actions

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/hostbind"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/storage"
)

// containerAction runs the sandbox's PID 1 (cube-agent) in its runtime:
// it starts it (create, clone: cold boot or restore from the snapshot's
// memory image), stops it (destroy), freezes and thaws it (pause, resume,
// snapshot) and re-roots it on another disk (rollback).
type containerAction struct{ n *Node }

func (*containerAction) Name() string { return "container" }

func (a *containerAction) Create(ctx context.Context, t *Task) error {
	rec := t.Record()
	d, err := a.n.Driver(rec.Runtime)
	if err != nil {
		return err
	}
	if boots := d.Capabilities().BootsDisk; (boots && rec.Disk == nil) || (!boots && rec.Mount == nil) {
		return fmt.Errorf("container: sandbox has no root filesystem: %w", errdefs.ErrFailedPrecondition)
	}
	c := &sandbox.Container{
		ID:         rec.HostKey(),
		Bundle:     filepath.Join(a.n.Cfg.SandboxRunDir(rec.HostKey()), "bundle"),
		CgroupPath: a.n.Cfg.CgroupPath(rec.HostKey()),
	}
	if err := t.Update(func(r *sandbox.Record) { r.Container = c }); err != nil {
		return err
	}
	if err := os.MkdirAll(c.Bundle, 0o700); err != nil {
		return err
	}
	spec, unstage, err := a.n.launchSpec(ctx, t.Record(), t.Template)
	if err != nil {
		return err
	}
	st, err := launch(ctx, d, t, spec)
	unstage()
	if err != nil {
		return err
	}
	return t.Update(func(r *sandbox.Record) { r.Container.PID = st.PID })
}

// specOf is the runtime spec of the sandbox's container.
func specOf(rec *sandbox.Record, c *sandbox.Container, tmpl *sandbox.Template) runtime.Spec {
	env := append([]string(nil), tmpl.Env...)
	if len(env) == 0 {
		env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	}
	for k, v := range rec.Env {
		env = append(env, k+"="+v)
	}
	env = append(env, agentproto.EnvSandboxID+"="+rec.ID, agentproto.EnvTemplateID+"="+rec.TemplateID)
	if wd := tmpl.DefaultWorkdir; wd != "" {
		// Commands start in the template's workdir (a template build's
		// setWorkdir), as in E2B.
		env = append(env, agentproto.WorkdirEnv+"="+wd)
	}
	var rootfs, disk string
	if rec.Mount != nil {
		rootfs = rec.Mount.Target
	} else if rec.Disk != nil {
		disk = rec.Disk.Path
	}
	return runtime.Spec{
		ID:         c.ID,
		BundleDir:  c.Bundle,
		RootFS:     rootfs,
		Disk:       disk,
		Args:       []string{AgentPath, "--addr", ":" + strconv.Itoa(agentproto.Port)},
		Env:        env,
		Cwd:        "/",
		Hostname:   rec.ID,
		CgroupPath: c.CgroupPath,
		NetNSPath:  rec.Network.RuntimeNetNS(),
		Limits: runtime.Limits{
			MilliCPU:  rec.Resources.MilliCPU,
			MemoryMiB: rec.Resources.MemoryMiB,
			Pids:      rec.Resources.Pids,
		},
		Labels:         rec.Labels,
		AgentTokenHash: tokenHash(rec.AccessToken),
		Resolver:       rec.Network.ResolverOf(),
		EgressCA:       rec.Network.EgressCAOf(),
	}
}

// tokenHash is the verifier of an access token the runtime hands the
// agent ("" for no token).
func tokenHash(token string) string {
	if token == "" {
		return ""
	}
	return agentproto.TokenHash(token)
}

// launchSpec is the runtime spec the sandbox starts (or is restored)
// with, rebuilt from the record and template. Its host mounts are staged
// (StageHostMounts): the caller calls unstage once the runtime has
// started or failed to, on every path.
func (n *Node) launchSpec(ctx context.Context, rec *sandbox.Record, tmpl *sandbox.Template) (spec runtime.Spec, unstage func(), err error) {
	unstage = func() {}
	if tmpl == nil {
		return spec, unstage, fmt.Errorf("sandbox %s: no template to build its spec: %w", rec.ID, errdefs.ErrInternal)
	}
	d, err := n.Driver(rec.Runtime)
	if err != nil {
		return spec, unstage, err
	}
	boots := d.Capabilities().BootsDisk
	spec = specOf(rec, rec.Container, tmpl)
	// Checked again right before the bind, and bound by descriptor: a
	// path component may have become a symlink since create validated it.
	if spec.Mounts, unstage, err = n.StageHostMounts(ctx, rec.HostKey(), rec.HostMounts, !boots); err != nil {
		return spec, unstage, err
	}
	if len(rec.Volumes) > 0 {
		if boots {
			unstage()
			return spec, func() {}, fmt.Errorf("volumes: runtime %q boots its own disk and binds no host directory; volumes are mounted on runc and gvisor only: %w", rec.Runtime, errdefs.ErrNotImplemented)
		}
		vols, err := n.MountVolumes(ctx, rec)
		if err != nil {
			unstage()
			return spec, func() {}, err
		}
		spec.Mounts = append(spec.Mounts, vols...)
	}
	if m, ok := n.sharedAgent(); ok && !boots {
		spec.Mounts = append(spec.Mounts, m)
	}
	return spec, unstage, nil
}

// launch starts the sandbox's container: restored from the memory image
// of the snapshot the task works from when its disk holds exactly that
// snapshot and the runtime can restore (clone, rollback), cold-booted
// otherwise (create, disk-only snapshots, runc, and an undone rollback
// whose disk is the old one again).
func launch(ctx context.Context, d runtime.Driver, t *Task, spec runtime.Spec) (runtime.State, error) {
	dir := memoryImage(d, t)
	if dir == "" {
		return d.Start(ctx, spec)
	}
	st, err := d.Restore(ctx, spec, dir)
	if err != nil {
		return st, err
	}
	// The image was taken with the agent quiesced (quiesce action): wake it;
	// the agent action then waits for its /health. The caller's undo
	// stops the container if this fails.
	if w, ok := d.(runtime.AgentWaker); ok {
		if err := w.WakeAgent(ctx, spec.ID); err != nil {
			return st, fmt.Errorf("wake restored agent: %w", err)
		}
	}
	return st, nil
}

// memoryImage is the memory image launch restores from, "" for a cold
// boot. The record's SourceSnapshotID names the snapshot the disk was
// cloned from at every instant (clone sets it at create, rollback when it
// swaps the disks and back), which is what makes disk and memory agree.
func memoryImage(d runtime.Driver, t *Task) string {
	sn := t.source()
	if sn == nil || !d.Capabilities().Restore {
		return ""
	}
	if !sn.HasMemory || sn.MemoryDir == "" || t.Record().SourceSnapshotID != sn.ID {
		return ""
	}
	return sn.MemoryDir
}

func (a *containerAction) Destroy(ctx context.Context, t *Task) error {
	rec := t.Record()
	if rec.Container == nil {
		// A sandbox paused to disk has no container but keeps its volumes.
		return a.n.UnmountVolumes(ctx, rec)
	}
	d, err := a.n.Driver(rec.Runtime)
	if err != nil {
		return err
	}
	if err := d.Stop(ctx, rec.Container.ID); err != nil {
		return err
	}
	if err := a.n.UnmountVolumes(ctx, rec); err != nil {
		return err
	}
	// Normally gone once the sandbox started; left by a cubelet that died
	// mid-start. Before any RemoveAll near it, which would reach through
	// a staging mount into the host directory.
	if err := hostbind.Unstage(a.n.HostMountsDir(rec.HostKey())); err != nil {
		return err
	}
	if err := os.RemoveAll(rec.Container.Bundle); err != nil {
		return err
	}
	removeIfEmpty(filepath.Dir(rec.Container.Bundle))
	return t.Update(func(r *sandbox.Record) { r.Container = nil })
}

func (a *containerAction) Pause(ctx context.Context, t *Task) error {
	rec := t.Record()
	if t.InitGone() {
		// The undo of a resume whose init died while frozen: the thaw
		// let the kill run, and the process may still be exiting (its
		// leader a zombie, other threads not yet out). A freeze now
		// would hold those threads in the freezer (cgroup v1's cannot
		// be left by a SIGKILL), so the exit would never complete and
		// the runtime watch would never see it: the sandbox would stay
		// Paused with no process. Left thawed, the exit completes and
		// the watch marks the sandbox Failed.
		return nil
	}
	d, err := a.n.Driver(rec.Runtime)
	if err != nil {
		return err
	}
	return Settle(ctx, d, rec.Container.ID, runtime.StatusPaused, d.Pause(ctx, rec.Container.ID))
}

func (a *containerAction) Resume(ctx context.Context, t *Task) error {
	rec := t.Record()
	d, err := a.n.Driver(rec.Runtime)
	if err != nil {
		return err
	}
	return Settle(ctx, d, rec.Container.ID, runtime.StatusRunning, d.Resume(ctx, rec.Container.ID))
}

// Snapshot freezes a running container so nothing writes to its disk
// while it is copied (holding Frozen until the thaw step). A paused one
// is frozen already.
func (a *containerAction) Snapshot(ctx context.Context, t *Task) error {
	run, err := snapshotRun(t)
	if err != nil {
		return err
	}
	rec := t.Record()
	if rec.Container == nil || run.Prev != lifecycle.Running {
		return nil
	}
	d, err := a.n.Driver(rec.Runtime)
	if err != nil {
		return err
	}
	if checkpointStops(d) {
		// The memory step's checkpoint stops the sandbox before the disk
		// is copied: a freeze now would only be thawed again for it
		// (runsc cannot checkpoint a paused sandbox), two runsc calls
		// on the snapshot's path.
		return nil
	}
	// Taken first: a pause that fails half-way must still be thawed.
	run.Holds.Take(Frozen, func(ctx context.Context) error {
		return Settle(ctx, d, rec.Container.ID, runtime.StatusRunning, d.Resume(ctx, rec.Container.ID))
	})
	return Settle(ctx, d, rec.Container.ID, runtime.StatusPaused, d.Pause(ctx, rec.Container.ID))
}

// UndoSnapshot thaws what Snapshot froze and nothing gave back yet.
func (a *containerAction) UndoSnapshot(ctx context.Context, t *Task) error {
	run, err := snapshotRun(t)
	if err != nil {
		return err
	}
	return run.Holds.Release(ctx, Frozen)
}

// Rollback re-roots the sandbox on the staged disk: stop the container,
// unmount, swap the disk files atomically, mount, start. It goes through
// the same Destroy and Create that destroy and create use, so the record
// names exactly what exists at every instant.
func (a *containerAction) Rollback(ctx context.Context, t *Task) error {
	run, err := rollbackRun(t)
	if err != nil {
		return err
	}
	rec := t.Record()
	if rec.Disk == nil || (rec.Mount == nil && !a.n.BootsDisk(rec.Runtime)) {
		return fmt.Errorf("rollback: sandbox has no mounted disk: %w", errdefs.ErrFailedPrecondition)
	}
	root := &rootfsAction{n: a.n}
	// Given back by UndoRollback itself, which restarts the old sandbox.
	run.Holds.Take(Stopped, nil)
	if err := a.Destroy(ctx, t); err != nil {
		return err
	}
	if err := root.Destroy(ctx, t); err != nil {
		return err
	}
	if err := storage.Exchange(rec.Disk.Path, StagedDisk(rec.Disk.Path)); err != nil {
		return err
	}
	// The record says which snapshot the disk now holds, at every instant;
	// swapping back restores the source it had.
	prevSource := rec.SourceSnapshotID
	run.Holds.Take(Swapped, func(context.Context) error {
		if err := storage.Exchange(rec.Disk.Path, StagedDisk(rec.Disk.Path)); err != nil {
			return err
		}
		run.Holds.Drop(Swapped)
		return t.Update(func(r *sandbox.Record) { r.SourceSnapshotID = prevSource })
	})
	if err := t.Update(func(r *sandbox.Record) { r.SourceSnapshotID = run.Snap.ID }); err != nil {
		return err
	}
	if err := root.Create(ctx, t); err != nil {
		return err
	}
	return a.Create(ctx, t)
}

// UndoRollback brings the sandbox back on its old disk, with its agent
// answering and, if it was paused, paused again. If this fails too the
// caller marks the sandbox Failed and releases it.
func (a *containerAction) UndoRollback(ctx context.Context, t *Task) error {
	run, err := rollbackRun(t)
	if err != nil || !run.Holds.Holds(Stopped) {
		return err
	}
	root := &rootfsAction{n: a.n}
	if err := a.Destroy(ctx, t); err != nil {
		return err
	}
	if err := root.Destroy(ctx, t); err != nil {
		return err
	}
	if err := run.Holds.Release(ctx, Swapped); err != nil {
		return err
	}
	if err := root.Create(ctx, t); err != nil {
		return err
	}
	if err := a.Create(ctx, t); err != nil {
		return err
	}
	if err := (&agentAction{n: a.n}).wait(ctx, t); err != nil {
		return err
	}
	run.Holds.Drop(Stopped)
	if run.Prev == lifecycle.Paused {
		return a.Pause(ctx, t)
	}
	return nil
}
