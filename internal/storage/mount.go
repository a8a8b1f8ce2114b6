package storage

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/hostload"
	"github.com/cubesandbox/cube/internal/loopdev"
)

// unmountRetries*: a sandbox's processes may take a moment to release the
// rootfs after they are killed, so EBUSY is retried before the lazy detach.
const (
	unmountRetries = 5
	unmountBackoff = 100 * time.Millisecond
)

// DiskMountFlags are the flags of every sandbox disk mount. The image is
// written by the sandbox's root, so a setuid binary or a device node in it
// must mean nothing on the host: nosuid and nodev. The mount is also the
// container's / (the runtime binds it), where the same flags apply: a
// setuid binary does not elevate and a device node in the image cannot be
// opened (the sandbox's /dev is a tmpfs with the standard set). Not
// noexec: the sandbox runs its programs from it.
const DiskMountFlags = unix.MS_NOSUID | unix.MS_NODEV

// MountDisk loop-mounts the ext4 image on target (created if missing) with
// DiskMountFlags and returns the loop device. The device is autoclear: it
// frees itself when the mount goes away. On failure everything MountDisk
// made is removed.
func MountDisk(ctx context.Context, image, target string, readOnly bool) (string, error) {
	return MountDiskWith(ctx, image, target, DiskOptions{ReadOnly: readOnly})
}

// DiskOptions say how MountDiskWith binds and mounts a disk image.
type DiskOptions struct {
	ReadOnly bool
	// DirectIO binds the loop device with direct I/O (diskLoopOptions).
	// The host then caches nothing of the image under the device, but a
	// write the pool cannot allocate (a full pool) reaches the disk's
	// ext4 as an I/O error, journal writes included, where a buffered
	// device passes the pool's ENOSPC on.
	DirectIO bool
}

// MountDiskWith is MountDisk with options.
func MountDiskWith(ctx context.Context, image, target string, o DiskOptions) (string, error) {
	readOnly := o.ReadOnly
	if err := ctx.Err(); err != nil {
		return "", err
	}
	if _, err := os.Stat(image); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return "", fmt.Errorf("storage: disk image %s: %w", image, errdefs.ErrNotFound)
		}
		return "", fmt.Errorf("storage: disk image: %w", err)
	}
	if mounted, err := IsMounted(target); err != nil {
		return "", err
	} else if mounted {
		return "", fmt.Errorf("storage: %s is already mounted: %w", target, errdefs.ErrAlreadyExists)
	}
	_, statErr := os.Lstat(target)
	created := errors.Is(statErr, os.ErrNotExist)
	if err := os.MkdirAll(target, 0o755); err != nil {
		return "", fmt.Errorf("storage: create mount point: %w", err)
	}
	var flags uintptr = DiskMountFlags
	if readOnly {
		flags |= unix.MS_RDONLY
	}
	dev, err := loopdev.AttachAutoclearWith(ctx, image, diskLoopOptions(image, o), func(dev string) error {
		if err := unix.Mount(dev, target, "ext4", flags, ""); err != nil {
			return fmt.Errorf("storage: mount %s (%s) on %s: %w", image, dev, target, err)
		}
		return nil
	})
	if err != nil {
		if created {
			_ = os.Remove(target)
		}
		return "", err
	}
	return dev, nil
}

// diskLoopOptions binds a disk buffered, or with direct I/O when o asks:
// the host then caches nothing of the image under the device, the
// sandbox's ext4 page cache (charged to its cgroup) being the only copy.
// Buffered, every block a sandbox read is cached twice, the second copy
// charged to no sandbox and shared with none (each disk is its own file).
// Direct I/O needs logical blocks of the file system's own size (at most
// 4 KiB, the most a loop device takes), read from its superblock; an
// image whose superblock cannot be read gets the kernel's default block
// size, and the mount then reports what is wrong with it.
func diskLoopOptions(image string, o DiskOptions) loopdev.Options {
	opts := loopdev.Options{ReadOnly: o.ReadOnly, DirectIO: o.DirectIO}
	if !o.DirectIO {
		return opts
	}
	if bs, err := ext4BlockSize(image); err == nil {
		opts.BlockSize = min(bs, 4096)
	}
	return opts
}

// ext4BlockSize reads the block size from an ext4 superblock (1 KiB into
// the image: s_log_block_size at +24, the magic 0xEF53 at +56).
func ext4BlockSize(image string) (uint32, error) {
	f, err := os.Open(image)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	var sb [64]byte
	if _, err := f.ReadAt(sb[:], 1024); err != nil {
		return 0, err
	}
	if binary.LittleEndian.Uint16(sb[56:]) != 0xEF53 {
		return 0, fmt.Errorf("storage: %s: no ext4 superblock: %w", image, errdefs.ErrInvalidArgument)
	}
	shift := binary.LittleEndian.Uint32(sb[24:])
	if shift > 6 { // 64 KiB, ext4's largest
		return 0, fmt.Errorf("storage: %s: ext4 block size 1 KiB << %d: %w", image, shift, errdefs.ErrInvalidArgument)
	}
	return 1024 << shift, nil
}

// UnmountDisk undoes MountDisk: it unmounts target (retrying EBUSY, then
// detaching lazily), unbinds any loop device still backed by image (skipped
// when image is ""), and removes the target directory. Calling it for
// something already gone is not an error.
//
// A loop device backed by image but mounted elsewhere is switched to
// autoclear by the kernel rather than torn away, so it survives until that
// other mount goes.
func UnmountDisk(ctx context.Context, target, image string) error {
	return UnmountDiskDev(ctx, target, image, "")
}

// UnmountDiskDev is UnmountDisk for a caller that recorded the loop device
// MountDisk returned: only that device is checked, instead of scanning
// every loop device on the host (which dominated destroy at scale).
func UnmountDiskDev(ctx context.Context, target, image, dev string) error {
	var errs []error
	if err := unmountAll(ctx, target); err != nil {
		errs = append(errs, err)
	}
	if image != "" {
		devs, err := devicesBackedBy(image, dev)
		if err != nil {
			errs = append(errs, err)
		}
		for _, d := range devs {
			if err := loopdev.Detach(d.Path); err != nil {
				errs = append(errs, err)
			}
		}
		if len(devs) > 0 && len(errs) == 0 && !waitDetached(ctx, image, dev) {
			for _, d := range devs {
				slog.WarnContext(ctx, "loop device still bound after the unmount; the kernel frees it when its last holder closes it",
					"device", d.Path, "image", image, "holders", loopHolders(d.Path))
			}
		}
	}
	if len(errs) == 0 {
		// Remove, not RemoveAll: if the unmount somehow did not happen,
		// RemoveAll would delete the sandbox's files through the mount.
		if err := os.Remove(target); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("storage: unmount %s: %w", target, err)
	}
	return nil
}

// unmountAll removes every mount stacked on target.
func unmountAll(ctx context.Context, target string) error {
	for range 16 {
		mounted, err := IsMounted(target)
		if err != nil || !mounted {
			return err
		}
		if err := unmountOne(ctx, target); err != nil {
			return err
		}
	}
	return fmt.Errorf("storage: %s: too many stacked mounts", target)
}

func unmountOne(ctx context.Context, target string) error {
	for i := 0; ; i++ {
		err := unix.Unmount(target, 0)
		switch {
		case err == nil, errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOENT):
			return nil
		case !errors.Is(err, unix.EBUSY):
			return fmt.Errorf("umount %s: %w", target, err)
		}
		if i == unmountRetries || ctx.Err() != nil {
			break
		}
		select {
		case <-ctx.Done():
		case <-time.After(unmountBackoff):
		}
	}
	slog.WarnContext(ctx, "mount still busy; detaching lazily", "target", target)
	if err := unix.Unmount(target, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("lazy umount %s: %w", target, err)
	}
	return nil
}

// IsMounted reports whether target is a mount point in this mount namespace.
// A target that does not exist is not mounted.
func IsMounted(target string) (bool, error) {
	abs, err := filepath.Abs(target)
	if err != nil {
		return false, fmt.Errorf("storage: %w", err)
	}
	if resolved, err := filepath.EvalSymlinks(abs); err == nil {
		abs = resolved
	} else if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	// openat2 with RESOLVE_NO_XDEV, not a scan of mountinfo: every
	// create and destroy asks, and mountinfo grows by a few lines with
	// every sandbox up (its disk, its id-mapped bind), so a scan made
	// each of them slower the more sandboxes ran.
	mounted, err := mountinfo.Mounted(abs)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil // removed since
	}
	if err != nil {
		// A target the lookup cannot reach (a dead filesystem mounted
		// there answers EIO or ENOTCONN) may still be a mount point
		// that must be unmounted: the table says.
		mounts, merr := mountinfo.GetMounts(mountinfo.SingleEntryFilter(abs))
		if merr != nil {
			return false, fmt.Errorf("storage: is %s mounted: %w", abs, errors.Join(err, merr))
		}
		return len(mounts) > 0, nil
	}
	return mounted, nil
}

// detachWait bounds waitDetached on an idle host; it is stretched by the
// load (hostload.Scale) up to detachWaitMax, which also bounds what a
// device that legitimately stays bound (a lazy unmount) costs a destroy.
const (
	detachWait    = 2 * time.Second
	detachWaitMax = 10 * time.Second
)

// waitDetached waits until no loop device is backed by image, and says
// whether that happened. The kernel frees an autoclear device when the
// superblock on it goes, which is after the last mount of it in any
// mount namespace: a sandbox process killed a moment ago (a gofer that
// held the root in its own namespace) may still be exiting, and on a busy
// host that takes more than a second. Without this wait a caller that
// removes the image next would leave a device backed by a deleted file,
// and a crash right then would leak it. After a lazy unmount the device
// legitimately lives on until the last holder closes it, and autoclear
// frees it then.
func waitDetached(ctx context.Context, image, dev string) bool {
	deadline := time.Now().Add(min(hostload.Scale(detachWait), detachWaitMax))
	for {
		devs, err := devicesBackedBy(image, dev)
		if err != nil {
			return false // cannot tell: the caller logs what it can
		}
		if len(devs) == 0 {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		select {
		case <-ctx.Done():
			return false
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// loopHolders names up to five processes with a mount of loop device dev
// in their mount namespace (what keeps an unmounted device bound), for a
// log line; a scan of every process, so only on that rare path.
func loopHolders(dev string) []string {
	b, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "dev"))
	if err != nil {
		return nil
	}
	num := " " + strings.TrimSpace(string(b)) + " "
	procs, _ := os.ReadDir("/proc")
	var out []string
	for _, p := range procs {
		if p.Name()[0] < '0' || p.Name()[0] > '9' {
			continue
		}
		mi, err := os.ReadFile(filepath.Join("/proc", p.Name(), "mountinfo"))
		if err != nil || !strings.Contains(string(mi), num) {
			continue
		}
		comm, _ := os.ReadFile(filepath.Join("/proc", p.Name(), "comm"))
		out = append(out, p.Name()+" "+strings.TrimSpace(string(comm)))
		if len(out) == 5 {
			break
		}
	}
	return out
}

// devicesBackedBy lists the loop devices backed by image: just dev when
// the caller knows it, else every device on the host.
func devicesBackedBy(image, dev string) ([]loopdev.Device, error) {
	if dev == "" {
		return loopdev.FindByBacking(image)
	}
	backing, err := loopdev.BackingOf(dev)
	if err != nil || backing == "" {
		return nil, err
	}
	abs, _ := filepath.Abs(image)
	if resolved, err := filepath.EvalSymlinks(abs); err == nil {
		abs = resolved
	}
	if backing != abs {
		return nil, nil
	}
	return []loopdev.Device{{Path: dev, BackingFile: backing}}, nil
}
