// Package storage is CubeCoW: a pool directory where template images and
// sandbox disks are copy-on-write clones of each other, and the loop mounts
// that turn a sandbox disk into an OCI rootfs.
//
// Pool layout (Dir is DataDir/pool):
//
//	Dir/templates/<templateID>/rootfs.img   ext4 image written by template import
//	Dir/sandboxes/<sandboxID>/disk.img      FICLONE of a template image
//
// OpenPool picks how clones are made, in order of preference:
//
//	reflink       Dir already sits on a reflink filesystem (XFS reflink=1, btrfs)
//	reflink-loop  Dir cannot reflink, so a sparse XFS image (ImagePath) is
//	              loop-mounted on Dir; on restart the existing image is re-mounted
//	copy          neither works and AllowCopy is set: sparse full copies (slow,
//	              uses real space per sandbox)
package storage

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/loopdev"
)

// Pool modes reported by Mode.
const (
	ModeReflink     = "reflink"
	ModeReflinkLoop = "reflink-loop"
	ModeCopy        = "copy"
)

// DefaultImageSizeBytes is the apparent size of a loop-backed pool image. The
// file is sparse, so only what the pool holds is allocated on the host.
const DefaultImageSizeBytes int64 = 20 << 30

// PoolConfig says where the pool lives and what it may fall back to.
type PoolConfig struct {
	Dir            string
	ImagePath      string // default Dir+".img"
	ImageSizeBytes int64  // default DefaultImageSizeBytes
	AllowCopy      bool
}

// Pool is an opened CubeCoW pool. Its methods are safe for concurrent use.
type Pool struct {
	dir   string
	image string
	mode  string
}

// OpenPool makes cfg.Dir usable for copy-on-write clones, mounting a
// loop-backed XFS image on it when the directory itself cannot reflink.
func OpenPool(ctx context.Context, cfg PoolConfig) (*Pool, error) {
	if cfg.Dir == "" {
		return nil, fmt.Errorf("storage: pool dir is empty: %w", errdefs.ErrInvalidArgument)
	}
	dir, err := filepath.Abs(cfg.Dir)
	if err != nil {
		return nil, fmt.Errorf("storage: pool dir: %w", err)
	}
	image := cfg.ImagePath
	if image == "" {
		image = dir + ".img"
	}
	if image, err = filepath.Abs(image); err != nil {
		return nil, fmt.Errorf("storage: pool image: %w", err)
	}
	if strings.HasPrefix(image, dir+string(filepath.Separator)) {
		// The image would be hidden by its own mount.
		return nil, fmt.Errorf("storage: pool image %s inside pool dir %s: %w", image, dir, errdefs.ErrInvalidArgument)
	}
	size := cfg.ImageSizeBytes
	if size <= 0 {
		size = DefaultImageSizeBytes
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("storage: create pool dir: %w", err)
	}
	p := &Pool{dir: dir, image: image}
	log := slog.With("pool", dir)

	probeErr := probeReflink(dir)
	if probeErr == nil {
		p.mode = ModeReflink
		if mounted, _ := IsMounted(dir); mounted {
			if devs, _ := loopdev.FindByBacking(image); len(devs) > 0 {
				// A previous cubelet mounted the image and it is still there
				// (maybe with older flags: they are set again, on this mount only).
				p.mode = ModeReflinkLoop
				if err := unix.Mount("", dir, "", unix.MS_REMOUNT|unix.MS_BIND|PoolMountFlags, ""); err != nil {
					return nil, fmt.Errorf("storage: remount pool %s with %#x: %w", dir, PoolMountFlags, err)
				}
			}
		}
		if err := p.seal(); err != nil {
			return nil, err
		}
		log.Info("storage pool opened", "mode", p.mode)
		return p, nil
	}
	log.Debug("pool dir cannot reflink", "err", probeErr)

	loopErr := p.mountImage(ctx, size, log)
	if loopErr == nil {
		if loopErr = probeReflink(dir); loopErr == nil {
			p.mode = ModeReflinkLoop
			if err := p.seal(); err != nil {
				_ = unmountAll(ctx, dir)
				return nil, err
			}
			log.Info("storage pool opened", "mode", p.mode, "image", image)
			return p, nil
		}
		loopErr = fmt.Errorf("reflink probe on mounted image: %w", loopErr)
		_ = unmountAll(ctx, dir)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if cfg.AllowCopy {
		p.mode = ModeCopy
		if err := p.seal(); err != nil {
			return nil, err
		}
		log.Warn("storage pool cannot reflink; falling back to full copies", "err", loopErr)
		return p, nil
	}
	return nil, fmt.Errorf("storage: pool %s cannot reflink and AllowCopy is off: %w: %w", dir, loopErr, errdefs.ErrFailedPrecondition)
}

// PoolMountFlags are the flags of the loop-backed pool mount. The pool
// holds images, clones, snapshots and memory images: files that are read,
// written, cloned and loop-mounted, never executed or used as devices on
// the host.
const PoolMountFlags = unix.MS_NOATIME | unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC

// seal makes the pool's root (the mounted image's root when there is one)
// root's alone: it holds every sandbox's disk and snapshots, with tenants'
// data, and setuid binaries a sandbox's root may have planted.
func (p *Pool) seal() error {
	if err := os.Chmod(p.dir, 0o700); err != nil {
		return fmt.Errorf("storage: seal pool dir: %w", err)
	}
	return nil
}

// mountImage mounts the pool image on the pool dir, creating and formatting
// it first when it does not exist yet.
func (p *Pool) mountImage(ctx context.Context, size int64, log *slog.Logger) error {
	if mounted, err := IsMounted(p.dir); err != nil {
		return err
	} else if mounted {
		return fmt.Errorf("%s is already a mount point of a non-reflink filesystem", p.dir)
	}
	if _, err := os.Stat(p.image); errors.Is(err, os.ErrNotExist) {
		if err := createXFSImage(ctx, p.image, size); err != nil {
			return err
		}
		log.Info("created loop-backed XFS image for the storage pool because the pool dir cannot reflink",
			"image", p.image, "size_bytes", size)
	} else if err != nil {
		return fmt.Errorf("stat pool image: %w", err)
	} else {
		log.Info("re-mounting existing pool image", "image", p.image)
	}
	// Autoclear: the device lives exactly as long as the mount, so an
	// unmount (or Teardown) never leaves a device behind.
	_, err := loopdev.AttachAutoclear(ctx, p.image, false, func(dev string) error {
		if err := unix.Mount(dev, p.dir, "xfs", PoolMountFlags, ""); err != nil {
			return fmt.Errorf("mount %s (%s) on %s: %w", p.image, dev, p.dir, err)
		}
		return nil
	})
	return err
}

// createXFSImage formats into a temporary name and renames, so an existing
// ImagePath always holds a complete filesystem and a crash mid-mkfs cannot
// make the restart path mount garbage.
func createXFSImage(ctx context.Context, image string, size int64) error {
	if err := os.MkdirAll(filepath.Dir(image), 0o755); err != nil {
		return fmt.Errorf("create pool image dir: %w", err)
	}
	tmp := image + ".tmp"
	_ = os.Remove(tmp)
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("create pool image: %w", err)
	}
	err = f.Truncate(size)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		out, merr := exec.CommandContext(ctx, "mkfs.xfs", "-q", "-m", "reflink=1", tmp).CombinedOutput()
		if merr != nil {
			err = fmt.Errorf("mkfs.xfs: %w: %s", merr, strings.TrimSpace(string(out)))
		}
	}
	if err == nil {
		err = os.Rename(tmp, image)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("create pool image %s: %w", image, err)
	}
	return nil
}

// probeReflink clones a small file inside dir; that is the only reliable
// test, since filesystem type alone does not say whether reflink=1.
func probeReflink(dir string) error {
	src, err := os.CreateTemp(dir, ".reflink-probe-*")
	if err != nil {
		return err
	}
	defer os.Remove(src.Name())
	defer src.Close()
	if _, err := src.WriteString("cube reflink probe\n"); err != nil {
		return err
	}
	dst, err := os.CreateTemp(dir, ".reflink-probe-*")
	if err != nil {
		return err
	}
	defer os.Remove(dst.Name())
	defer dst.Close()
	return unix.IoctlFileClone(int(dst.Fd()), int(src.Fd()))
}

// Mode is one of ModeReflink, ModeReflinkLoop, ModeCopy.
func (p *Pool) Mode() string { return p.mode }

// Dir is the absolute pool directory.
func (p *Pool) Dir() string { return p.dir }

// Close releases the handle. It deliberately leaves the pool mounted:
// sandbox disks cloned from it stay mounted and running across cubelet
// restarts, and the next OpenPool adopts the mount.
func (p *Pool) Close() error { return nil }

// Teardown unmounts a loop-backed pool and unbinds its loop device (for
// tests and uninstall). If sandbox disks from the pool are still mounted the
// pool mount is detached lazily: it vanishes from the namespace at once but
// the filesystem and its loop device live until those disks are unmounted.
// For other modes it does nothing.
func (p *Pool) Teardown(ctx context.Context) error {
	if p.mode != ModeReflinkLoop {
		return nil
	}
	var errs []error
	if err := unmountAll(ctx, p.dir); err != nil {
		errs = append(errs, err)
	}
	devs, err := loopdev.FindByBacking(p.image)
	if err != nil {
		errs = append(errs, err)
	}
	for _, d := range devs {
		if err := loopdev.Detach(d.Path); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("storage: teardown pool %s: %w", p.dir, err)
	}
	return nil
}
