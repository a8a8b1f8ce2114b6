// Package loopdev attaches regular files to Linux loop block devices with
// ioctls, without shelling out to losetup.
//
// Two lifetimes exist and callers must pick one:
//
//   - Attach binds a file to a device that stays bound until Detach. Use it
//     when nothing will keep the device open (tools that need a block device
//     for a moment, tests).
//   - AttachAutoclear binds with LO_FLAGS_AUTOCLEAR and holds the device open
//     only while the caller's use func runs (typically a mount). The kernel
//     clears an autoclear device on its last close, so once the mount goes
//     away the device frees itself, and if use fails the device is gone as
//     soon as we close it: no rollback is needed and nothing can leak when
//     the process dies in between.
//
// Both are safe to call from many goroutines at once: LOOP_CTL_GET_FREE
// hands the same free number to racing callers and the losers see EBUSY
// when they bind, so they ask again.
package loopdev

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
)

const (
	controlPath = "/dev/loop-control"
	sysBlock    = "/sys/block"
	// maxAttempts bounds retries of the GET_FREE/bind race; each retry
	// means another attacher won a device, so this is far more than 50
	// concurrent callers need.
	maxAttempts = 1000
)

// Device is one bound loop device as the kernel reports it in sysfs.
type Device struct {
	Path        string // /dev/loopN
	BackingFile string // as the kernel prints it; may end in " (deleted)"
}

// Options are how a device is bound.
type Options struct {
	ReadOnly bool
	// DirectIO has the device read and write its backing file with
	// O_DIRECT (LO_FLAGS_DIRECT_IO): a file system on the device is then
	// cached once, in its own page cache, instead of a second time under
	// the backing file, which the kernel charges to nobody's cgroup. The
	// kernel quietly stays buffered where the backing file cannot do
	// direct I/O at BlockSize (tmpfs, a coarser alignment); DirectIO
	// reports what it chose.
	DirectIO bool
	// BlockSize is the device's logical block size (512, 1024, 2048 or
	// 4096; 0 keeps the kernel's choice). Direct I/O needs it at least the
	// backing file system's alignment, and a file system on the device
	// must use blocks at least this large.
	BlockSize uint32
}

// Attach binds backingFile to a free loop device without autoclear. The
// device stays bound until Detach, even after it is mounted and unmounted.
func Attach(ctx context.Context, backingFile string, readOnly bool) (string, error) {
	dev, f, err := attach(ctx, backingFile, Options{ReadOnly: readOnly}, false)
	if err != nil {
		return "", err
	}
	_ = f.Close()
	return dev, nil
}

// AttachAutoclear binds backingFile with LO_FLAGS_AUTOCLEAR and calls use
// with the device path while holding the device open. The device is freed
// by the kernel when the last opener (for example a mount made by use) goes
// away; if use returns an error, the device is released on return.
func AttachAutoclear(ctx context.Context, backingFile string, readOnly bool, use func(devPath string) error) (string, error) {
	return AttachAutoclearWith(ctx, backingFile, Options{ReadOnly: readOnly}, use)
}

// AttachAutoclearWith is AttachAutoclear with the device bound as opts say.
func AttachAutoclearWith(ctx context.Context, backingFile string, opts Options, use func(devPath string) error) (string, error) {
	dev, f, err := attach(ctx, backingFile, opts, true)
	if err != nil {
		return "", err
	}
	// Closing our fd is what lets the kernel autoclear the device when use
	// did not take a reference of its own.
	defer f.Close()
	if err := use(dev); err != nil {
		return "", err
	}
	return dev, nil
}

func attach(ctx context.Context, backingFile string, opts Options, autoclear bool) (string, *os.File, error) {
	if backingFile == "" {
		return "", nil, fmt.Errorf("loopdev: empty backing file: %w", errdefs.ErrInvalidArgument)
	}
	if bs := opts.BlockSize; bs != 0 && (bs < 512 || bs > 4096 || bs&(bs-1) != 0) {
		return "", nil, fmt.Errorf("loopdev: block size %d is not a power of two in 512..4096: %w", bs, errdefs.ErrInvalidArgument)
	}
	readOnly := opts.ReadOnly
	flag := os.O_RDWR
	if readOnly {
		flag = os.O_RDONLY
	}
	back, err := os.OpenFile(backingFile, flag|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return "", nil, fmt.Errorf("loopdev: backing file %s: %w", backingFile, errdefs.ErrNotFound)
		}
		return "", nil, fmt.Errorf("loopdev: open backing file: %w", err)
	}
	defer back.Close()

	ctl, err := os.OpenFile(controlPath, os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", nil, fmt.Errorf("loopdev: open %s: %w", controlPath, err)
	}
	defer ctl.Close()

	var info unix.LoopInfo64
	copy(info.File_name[:len(info.File_name)-1], backingFile)
	if autoclear {
		info.Flags |= unix.LO_FLAGS_AUTOCLEAR
	}
	if readOnly {
		info.Flags |= unix.LO_FLAGS_READ_ONLY
	}
	if opts.DirectIO {
		info.Flags |= unix.LO_FLAGS_DIRECT_IO
	}

	for attempt := 0; attempt < maxAttempts; attempt++ {
		if err := ctx.Err(); err != nil {
			return "", nil, err
		}
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return "", nil, fmt.Errorf("loopdev: LOOP_CTL_GET_FREE: %w", err)
		}
		devPath := fmt.Sprintf("/dev/loop%d", n)
		dev, err := openDevice(ctx, devPath, n)
		if err != nil {
			return "", nil, err
		}
		err = bind(dev, int(back.Fd()), &info, opts.BlockSize)
		if err == nil {
			return devPath, dev, nil
		}
		_ = dev.Close()
		if errors.Is(err, unix.EBUSY) {
			// Another attacher bound this number between GET_FREE and
			// our bind; ask for the next free one.
			continue
		}
		return "", nil, fmt.Errorf("loopdev: bind %s to %s: %w", backingFile, devPath, err)
	}
	return "", nil, fmt.Errorf("loopdev: no free loop device after %d attempts: %w", maxAttempts, errdefs.ErrResourceExhausted)
}

// openDevice opens the node for loop number n. devtmpfs creates the node
// when GET_FREE adds the device, but on hosts with a static /dev it may be
// missing, so make it from the numbers sysfs reports.
func openDevice(ctx context.Context, devPath string, n int) (*os.File, error) {
	for i := 0; ; i++ {
		f, err := os.OpenFile(devPath, os.O_RDWR|unix.O_CLOEXEC, 0)
		if err == nil {
			return f, nil
		}
		if !errors.Is(err, os.ErrNotExist) || i >= 50 {
			return nil, fmt.Errorf("loopdev: open %s: %w", devPath, err)
		}
		if raw, rerr := os.ReadFile(fmt.Sprintf("%s/loop%d/dev", sysBlock, n)); rerr == nil {
			var major, minor uint32
			if _, serr := fmt.Sscanf(strings.TrimSpace(string(raw)), "%d:%d", &major, &minor); serr == nil {
				_ = unix.Mknod(devPath, unix.S_IFBLK|0o660, int(unix.Mkdev(major, minor)))
				continue
			}
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// bind prefers LOOP_CONFIGURE (one atomic ioctl, Linux 5.8+) and falls back
// to the older SET_FD + SET_STATUS64 (+ SET_BLOCK_SIZE, SET_DIRECT_IO)
// when the kernel lacks it.
func bind(dev *os.File, backFd int, info *unix.LoopInfo64, blockSize uint32) error {
	fd := int(dev.Fd())
	cfg := unix.LoopConfig{Fd: uint32(backFd), Size: blockSize, Info: *info}
	err := unix.IoctlLoopConfigure(fd, &cfg)
	if err == nil || !errors.Is(err, unix.EINVAL) {
		return err
	}
	if err := unix.IoctlSetInt(fd, unix.LOOP_SET_FD, backFd); err != nil {
		return err
	}
	legacy := *info
	legacy.Flags &^= unix.LO_FLAGS_DIRECT_IO // not settable through SET_STATUS64
	err = unix.IoctlLoopSetStatus64(fd, &legacy)
	if err == nil && blockSize != 0 {
		err = unix.IoctlSetInt(fd, unix.LOOP_SET_BLOCK_SIZE, int(blockSize))
	}
	if err == nil && info.Flags&unix.LO_FLAGS_DIRECT_IO != 0 {
		// Best effort, as LOOP_CONFIGURE is: EINVAL means the backing
		// file cannot do direct I/O, and the device stays buffered.
		if derr := unix.IoctlSetInt(fd, unix.LOOP_SET_DIRECT_IO, 1); derr != nil && !errors.Is(derr, unix.EINVAL) {
			err = derr
		}
	}
	if err != nil {
		// Undo SET_FD so a half-configured device does not linger.
		_ = unix.IoctlSetInt(fd, unix.LOOP_CLR_FD, 0)
		return err
	}
	return nil
}

// Detach unbinds devPath. A device that does not exist or is already unbound
// is not an error. A device still in use (mounted) is switched to autoclear
// by the kernel and frees itself when the last user goes away.
func Detach(devPath string) error {
	f, err := os.OpenFile(devPath, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ENXIO) {
			return nil
		}
		return fmt.Errorf("loopdev: open %s: %w", devPath, err)
	}
	defer f.Close()
	if err := unix.IoctlSetInt(int(f.Fd()), unix.LOOP_CLR_FD, 0); err != nil {
		if errors.Is(err, unix.ENXIO) {
			return nil
		}
		return fmt.Errorf("loopdev: LOOP_CLR_FD %s: %w", devPath, err)
	}
	return nil
}

// List returns every bound loop device.
func List() ([]Device, error) {
	paths, err := filepath.Glob(sysBlock + "/loop*/loop/backing_file")
	if err != nil {
		return nil, fmt.Errorf("loopdev: list: %w", err)
	}
	devs := make([]Device, 0, len(paths))
	for _, p := range paths {
		raw, err := os.ReadFile(p)
		if err != nil {
			// The device was cleared between the glob and the read.
			continue
		}
		name := filepath.Base(filepath.Dir(filepath.Dir(p)))
		devs = append(devs, Device{Path: "/dev/" + name, BackingFile: strings.TrimRight(string(raw), "\n")})
	}
	return devs, nil
}

// FindByBacking returns the bound devices whose backing file is file. A
// backing file deleted after attach still matches.
func FindByBacking(file string) ([]Device, error) {
	abs, err := filepath.Abs(file)
	if err != nil {
		return nil, fmt.Errorf("loopdev: %w", err)
	}
	if resolved, err := filepath.EvalSymlinks(abs); err == nil {
		abs = resolved
	}
	all, err := List()
	if err != nil {
		return nil, err
	}
	var out []Device
	for _, d := range all {
		if strings.TrimSuffix(d.BackingFile, " (deleted)") == abs {
			out = append(out, d)
		}
	}
	return out, nil
}

// BackingOf returns the backing file of one loop device ("" when the
// device is unbound or absent) without scanning every device: destroy
// paths know their device and must not cost O(devices on the host).
func BackingOf(devPath string) (string, error) {
	data, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(devPath), "loop", "backing_file"))
	// ENODEV: the device was being cleared (autoclear at the last
	// unmount) while sysfs answered; unbound all the same.
	if errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ENODEV) || errors.Is(err, unix.ENXIO) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("loopdev: %w", err)
	}
	return strings.TrimSuffix(strings.TrimSpace(string(data)), " (deleted)"), nil
}

// DirectIO reports whether the bound device devPath does direct I/O to its
// backing file (what the kernel chose for Options.DirectIO).
func DirectIO(devPath string) (bool, error) {
	data, err := os.ReadFile(filepath.Join(sysBlock, filepath.Base(devPath), "loop", "dio"))
	if err != nil {
		return false, fmt.Errorf("loopdev: %w", err)
	}
	return strings.TrimSpace(string(data)) == "1", nil
}

// BlockSize returns the logical block size of the device devPath.
func BlockSize(devPath string) (uint32, error) {
	data, err := os.ReadFile(filepath.Join(sysBlock, filepath.Base(devPath), "queue", "logical_block_size"))
	if err != nil {
		return 0, fmt.Errorf("loopdev: %w", err)
	}
	n, err := strconv.ParseUint(strings.TrimSpace(string(data)), 10, 32)
	if err != nil {
		return 0, fmt.Errorf("loopdev: logical_block_size of %s: %w", devPath, err)
	}
	return uint32(n), nil
}
