package actions

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/loopdev"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/storage"
)

// volumeMu serialises mounting, unmounting and deleting volumes on the
// node: "is it mounted, by whom" and the mount itself are one step.
var volumeMu sync.Mutex

// VolumeDir is where volume id is loop-mounted while a sandbox uses it;
// the file VolumeDir+".owner" names that sandbox.
func (n *Node) VolumeDir(id string) string {
	return filepath.Join(n.Cfg.Node.RunDir, "volumes", id)
}

// MountVolumes makes the record's volumes ready for its container and
// returns the binds: each image is made on first use
// (storage.CreateVolumeImage), loop-mounted once on VolumeDir and bound
// from there. A volume is mounted by one sandbox at a time (two ext4
// mounts of one image would corrupt it): a volume another sandbox holds is
// FailedPrecondition. A sandbox that starts again (resume, restore) finds
// its own mounts in place. On failure, what this call mounted or made is
// undone.
func (n *Node) MountVolumes(ctx context.Context, rec *sandbox.Record) (mounts []runtime.Mount, err error) {
	if len(rec.Volumes) == 0 {
		return nil, nil
	}
	volumeMu.Lock()
	defer volumeMu.Unlock()
	var undo []func()
	defer func() {
		if err != nil {
			for i := len(undo) - 1; i >= 0; i-- {
				undo[i]()
			}
		}
	}()
	for _, v := range rec.Volumes {
		target := n.VolumeDir(v.ID)
		owner, mounted, err := volumeOwner(target)
		if err != nil {
			return nil, err
		}
		switch {
		case mounted && owner == rec.ID:
		case mounted:
			return nil, fmt.Errorf("volume %s is mounted by sandbox %s (one sandbox at a time): %w", v.ID, owner, errdefs.ErrFailedPrecondition)
		default:
			if err := n.mountVolume(ctx, rec.ID, v, target, &undo); err != nil {
				return nil, err
			}
		}
		mounts = append(mounts, runtime.Mount{Source: target, Destination: v.Path})
	}
	return mounts, nil
}

// mountVolume makes (when new) and mounts one volume for sandbox id,
// appending its undo.
func (n *Node) mountVolume(ctx context.Context, id string, v sandbox.Volume, target string, undo *[]func()) error {
	img := n.Pool.VolumeImagePath(v.ID)
	created, err := n.Pool.CreateVolumeImage(ctx, v.ID, v.SizeMiB)
	if err != nil {
		return fmt.Errorf("volume %s: %w", v.ID, err)
	}
	if created {
		*undo = append(*undo, func() { _, _ = n.Pool.RemoveVolumeImage(v.ID) })
		// A create that fails later (the runtime, the agent) removes
		// what it made: UnmountVolumes reads this.
		if err := os.WriteFile(madeByPath(img), []byte(id), 0o600); err != nil {
			return fmt.Errorf("volume %s: %w", v.ID, err)
		}
	} else if devs, err := loopdev.FindByBacking(img); err != nil {
		return fmt.Errorf("volume %s: %w", v.ID, err)
	} else if len(devs) > 0 {
		// Attached without our mount (a mount left elsewhere): refuse
		// rather than mount the same ext4 twice.
		return fmt.Errorf("volume %s: its image is attached to %s: %w", v.ID, devs[0].Path, errdefs.ErrFailedPrecondition)
	}
	if err := os.MkdirAll(filepath.Dir(target), 0o700); err != nil {
		return fmt.Errorf("volume %s: %w", v.ID, err)
	}
	// The owner before the mount: a cubelet that dies between the two
	// leaves an owned, unmounted volume (the next mount takes it over),
	// never a mounted one that names no owner and that nothing releases.
	if err := os.WriteFile(target+".owner", []byte(id), 0o600); err != nil {
		return fmt.Errorf("volume %s: %w", v.ID, err)
	}
	*undo = append(*undo, func() { _ = os.Remove(target + ".owner") })
	if _, err := storage.MountDiskWith(ctx, img, target, storage.DiskOptions{DirectIO: n.Cfg.Storage.LoopDirectIO}); err != nil {
		return fmt.Errorf("volume %s: %w", v.ID, err)
	}
	*undo = append(*undo, func() {
		if err := storage.UnmountDisk(context.WithoutCancel(ctx), target, img); err != nil {
			slog.WarnContext(ctx, "volume: undo mount", "volume", v.ID, "err", err)
		}
	})
	if created {
		// The sandbox's user is not root: the volume's root is shared
		// like /tmp (sticky, anyone may create).
		if err := os.Chmod(target, 0o1777); err != nil {
			return fmt.Errorf("volume %s: %w", v.ID, err)
		}
		_ = os.Remove(filepath.Join(target, "lost+found"))
	}
	return nil
}

// UnmountVolumes releases the record's volumes once its container is
// gone; volumes another sandbox holds (never this one's) are left alone.
// A sandbox still being created (its create failed) also removes the
// images its create made, so a failed create leaves no volume file.
func (n *Node) UnmountVolumes(ctx context.Context, rec *sandbox.Record) error {
	if len(rec.Volumes) == 0 {
		return nil
	}
	volumeMu.Lock()
	defer volumeMu.Unlock()
	var errs []error
	for _, v := range rec.Volumes {
		target := n.VolumeDir(v.ID)
		owner, mounted, err := volumeOwner(target)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if owner != rec.ID && (mounted || owner != "") {
			continue
		}
		if err := storage.UnmountDisk(ctx, target, n.Pool.VolumeImagePath(v.ID)); err != nil {
			errs = append(errs, fmt.Errorf("volume %s: %w", v.ID, err))
			continue
		}
		if err := os.Remove(target + ".owner"); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
		img := n.Pool.VolumeImagePath(v.ID)
		if b, err := os.ReadFile(madeByPath(img)); err == nil && rec.State == lifecycle.Creating && string(b) == rec.ID {
			if _, err := n.Pool.RemoveVolumeImage(v.ID); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// madeByPath names the sandbox whose create made the image img.
func madeByPath(img string) string { return filepath.Join(filepath.Dir(img), "made-by") }

// DeleteVolume removes volume id's image; FailedPrecondition while it is
// mounted.
func (n *Node) DeleteVolume(ctx context.Context, id string) (existed bool, err error) {
	if err := storage.ValidateID(id); err != nil {
		return false, err
	}
	volumeMu.Lock()
	defer volumeMu.Unlock()
	owner, mounted, err := volumeOwner(n.VolumeDir(id))
	if err != nil {
		return false, err
	}
	if mounted {
		return false, fmt.Errorf("volume %s is mounted by sandbox %s: %w", id, owner, errdefs.ErrFailedPrecondition)
	}
	if devs, err := loopdev.FindByBacking(n.Pool.VolumeImagePath(id)); err != nil {
		return false, err
	} else if len(devs) > 0 {
		return false, fmt.Errorf("volume %s: its image is attached to %s: %w", id, devs[0].Path, errdefs.ErrFailedPrecondition)
	}
	_ = os.Remove(n.VolumeDir(id))
	_ = os.Remove(n.VolumeDir(id) + ".owner")
	return n.Pool.RemoveVolumeImage(id)
}

// volumeOwner says whether target is mounted and which sandbox the owner
// file names ("" when none).
func volumeOwner(target string) (owner string, mounted bool, err error) {
	mounted, err = storage.IsMounted(target)
	if err != nil {
		return "", false, err
	}
	b, err := os.ReadFile(target + ".owner")
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return "", false, err
	}
	return strings.TrimSpace(string(b)), mounted, nil
}
