package actions

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/storage"
)

// The storage actions: "pool" opens the node's reflink pool (init),
// "disk" owns the sandbox's disk image (create, clone, snapshot,
// rollback, destroy), "rootfs" its loop mount (create, snapshot flush,
// destroy).

// poolAction opens the reflink storage pool (init).
type poolAction struct{ n *Node }

func (*poolAction) Name() string { return "pool" }

func (a *poolAction) Init(ctx context.Context) error {
	c := a.n.Cfg
	p, err := storage.OpenPool(ctx, storage.PoolConfig{
		Dir:            c.PoolDir(),
		ImageSizeBytes: c.Storage.PoolImageSizeMiB << 20,
		AllowCopy:      c.Storage.AllowCopy,
	})
	if err != nil {
		return err
	}
	a.n.Pool = p
	return nil
}

// DiskSource names a template image for the disk pool. The template's
// creation time is its generation: a template deleted and imported again
// under the same ID never gets a ready disk of the old image.
func DiskSource(t *sandbox.Template) storage.DiskSource {
	gen := t.CreatedAt
	if !t.RebuiltAt.IsZero() {
		gen = t.RebuiltAt // ready disks of the image before the rebuild are stale
	}
	return storage.DiskSource{TemplateID: t.ID, Image: t.ImagePath, Gen: gen.UnixNano()}
}

// templateDisk puts a disk of template t at path: a ready one from the
// disk pool when there is one, a clone made now otherwise.
func (n *Node) templateDisk(ctx context.Context, t *sandbox.Template, path string) error {
	if n.Disks == nil {
		return n.Pool.Clone(ctx, t.ImagePath, path)
	}
	_, err := n.Disks.Take(ctx, DiskSource(t), path)
	return err
}

// diskAction gives the sandbox its own copy-on-write clone of the
// template image (create) or of a snapshot disk (clone), copies it into a
// snapshot, and stages a snapshot's disk for a rollback.
type diskAction struct{ n *Node }

func (*diskAction) Name() string { return "disk" }

func (a *diskAction) Create(ctx context.Context, t *Task) error {
	rec := t.Record()
	path := a.n.Pool.SandboxDiskPath(rec.HostKey())
	if err := t.Update(func(r *sandbox.Record) { r.Disk = &sandbox.Disk{Path: path} }); err != nil {
		return err
	}
	if err := a.n.templateDisk(ctx, t.Template, path); err != nil {
		return fmt.Errorf("clone template disk: %w", err)
	}
	if want := rec.Resources.DiskMiB << 20; want > 0 {
		if err := growExt4(ctx, path, want); err != nil {
			return err
		}
	}
	return nil
}

func (a *diskAction) Destroy(_ context.Context, t *Task) error {
	rec := t.Record()
	if rec.Disk == nil {
		return nil
	}
	if err := a.n.Pool.RemoveSandboxDisk(rec.HostKey()); err != nil {
		return err
	}
	return t.Update(func(r *sandbox.Record) { r.Disk = nil })
}

// Clone gives a new sandbox its own clone of the snapshot disk, grown to
// the requested size.
func (a *diskAction) Clone(ctx context.Context, t *Task) error {
	sn, err := cloneSource(t)
	if err != nil {
		return err
	}
	rec := t.Record()
	path := a.n.Pool.SandboxDiskPath(rec.HostKey())
	if err := t.Update(func(r *sandbox.Record) { r.Disk = &sandbox.Disk{Path: path} }); err != nil {
		return err
	}
	if err := a.n.Pool.Clone(ctx, sn.DiskPath, path); err != nil {
		return fmt.Errorf("clone snapshot disk: %w", err)
	}
	if want := rec.Resources.DiskMiB << 20; want > 0 {
		return growExt4(ctx, path, want)
	}
	return nil
}

// Snapshot clones the (frozen, flushed) sandbox disk into the snapshot.
func (a *diskAction) Snapshot(ctx context.Context, t *Task) error {
	run, err := snapshotRun(t)
	if err != nil {
		return err
	}
	rec := t.Record()
	if rec.Disk == nil {
		return fmt.Errorf("snapshot: sandbox has no disk: %w", errdefs.ErrFailedPrecondition)
	}
	return a.n.Pool.Clone(ctx, rec.Disk.Path, run.Snap.DiskPath)
}

func (a *diskAction) UndoSnapshot(_ context.Context, t *Task) error {
	run, err := snapshotRun(t)
	if err != nil {
		return err
	}
	if err := os.Remove(run.Snap.DiskPath); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// StagedDisk is where a rollback puts the snapshot's clone before the
// sandbox is stopped; after the swap it holds the old disk until the
// rollback is done.
func StagedDisk(diskPath string) string { return diskPath + ".staged" }

// Rollback stages a clone of the snapshot disk next to the sandbox's
// disk. Nothing of the sandbox is touched yet, so a failure here leaves
// it running as it was.
func (a *diskAction) Rollback(ctx context.Context, t *Task) error {
	run, err := rollbackRun(t)
	if err != nil {
		return err
	}
	rec := t.Record()
	if rec.Disk == nil {
		return fmt.Errorf("rollback: sandbox has no disk: %w", errdefs.ErrFailedPrecondition)
	}
	staged := StagedDisk(rec.Disk.Path)
	if err := os.Remove(staged); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	if err := a.n.Pool.Clone(ctx, run.Snap.DiskPath, staged); err != nil {
		return fmt.Errorf("stage snapshot disk: %w", err)
	}
	if want := rec.Resources.DiskMiB << 20; want > 0 {
		return growExt4(ctx, staged, want)
	}
	return nil
}

// UndoRollback removes the staged disk (by then the snapshot's clone
// again, the container action's undo having swapped the disks back).
func (a *diskAction) UndoRollback(_ context.Context, t *Task) error {
	rec := t.Record()
	if rec.Disk == nil {
		return nil
	}
	if err := os.Remove(StagedDisk(rec.Disk.Path)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// growExt4 enlarges an unmounted ext4 image to size bytes; a smaller size
// than the image already has is left alone (shrinking would lose data).
func growExt4(ctx context.Context, path string, size int64) error {
	st, err := os.Stat(path)
	if err != nil {
		return err
	}
	if size <= st.Size() {
		return nil
	}
	if err := os.Truncate(path, size); err != nil {
		return fmt.Errorf("grow disk: %w", err)
	}
	out, err := exec.CommandContext(ctx, "resize2fs", "-f", path).CombinedOutput()
	if err != nil {
		return fmt.Errorf("resize2fs: %v: %s", err, out)
	}
	return nil
}

// rootfsAction loop-mounts the sandbox disk as the container's root.
type rootfsAction struct{ n *Node }

func (*rootfsAction) Name() string { return "rootfs" }

func (a *rootfsAction) Create(ctx context.Context, t *Task) error {
	rec := t.Record()
	if rec.Disk == nil {
		return fmt.Errorf("rootfs: sandbox has no disk: %w", errdefs.ErrFailedPrecondition)
	}
	if a.n.BootsDisk(rec.Runtime) {
		return nil // the VM mounts its disk itself
	}
	target := filepath.Join(a.n.Cfg.SandboxRunDir(rec.HostKey()), "rootfs")
	if err := t.Update(func(r *sandbox.Record) {
		r.Mount = &sandbox.Mount{Target: target, Image: rec.Disk.Path}
	}); err != nil {
		return err
	}
	dev, err := storage.MountDiskWith(ctx, rec.Disk.Path, target, storage.DiskOptions{DirectIO: a.n.Cfg.Storage.LoopDirectIO})
	if err != nil {
		return err
	}
	return t.Update(func(r *sandbox.Record) { r.Mount.LoopDevice = dev })
}

func (a *rootfsAction) Destroy(ctx context.Context, t *Task) error {
	rec := t.Record()
	if rec.Mount == nil {
		return nil
	}
	if err := storage.UnmountDiskDev(ctx, rec.Mount.Target, rec.Mount.Image, rec.Mount.LoopDevice); err != nil {
		return err
	}
	removeIfEmpty(filepath.Dir(rec.Mount.Target))
	return t.Update(func(r *sandbox.Record) { r.Mount = nil })
}

// Snapshot flushes the sandbox's filesystem, so the loop image under it
// holds every write made before the freeze.
func (a *rootfsAction) Snapshot(_ context.Context, t *Task) error {
	rec := t.Record()
	if rec.Mount == nil && a.n.BootsDisk(rec.Runtime) {
		// A VM's writes are in its memory image or already in the disk
		// file: QEMU drains and flushes its block devices when a
		// migration completes.
		return nil
	}
	if rec.Mount == nil {
		return fmt.Errorf("snapshot: sandbox has no root filesystem: %w", errdefs.ErrFailedPrecondition)
	}
	return storage.Syncfs(rec.Mount.Target)
}

// UndoSnapshot has nothing to undo: a flush changes nothing.
func (a *rootfsAction) UndoSnapshot(context.Context, *Task) error { return nil }
