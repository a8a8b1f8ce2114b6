// Package fsfreeze freezes and thaws a filesystem (FIFREEZE / FITHAW), so
// cubelet can copy a sandbox's disk while no write is half done.
//
// A frozen root filesystem blocks every writer in the sandbox, so a freeze
// always carries a deadline: if the thaw never comes (cubelet crashed
// between the two calls), the Freezer thaws by itself.
//
// FIFREEZE needs CAP_SYS_ADMIN. The runc spec leaves it out of sandboxes on
// purpose, so in a runc sandbox Freeze fails with a FailedPrecondition that
// says so, and cubelet freezes from the host side instead (pause); in a VM
// the agent is the guest's init and has it.
package fsfreeze

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// The ioctls (linux/fs.h: _IOWR('X', 119/120, int)); x/sys lacks them.
const (
	fifreeze = 0xC0045877
	fithaw   = 0xC0045878
)

// MaxTimeout bounds how long a filesystem may stay frozen.
const MaxTimeout = 5 * time.Minute

// Freezer freezes one mount point.
type Freezer struct {
	Path string // the mount point; "/" when empty
	Log  *slog.Logger

	mu    sync.Mutex
	timer *time.Timer // pending auto-thaw; non-nil while we hold a freeze
	until time.Time
}

func (f *Freezer) path() string {
	if f.Path == "" {
		return "/"
	}
	return f.Path
}

// Freeze freezes the filesystem and arms an automatic thaw after timeout.
func (f *Freezer) Freeze(timeout time.Duration) (time.Time, error) {
	if timeout <= 0 || timeout > MaxTimeout {
		return time.Time{}, fmt.Errorf("freeze timeout %s: want (0, %s]: %w", timeout, MaxTimeout, errdefs.ErrInvalidArgument)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.timer != nil {
		return time.Time{}, fmt.Errorf("%s is already frozen until %s: %w", f.path(), f.until.Format(time.RFC3339), errdefs.ErrAlreadyExists)
	}
	if err := ioctl(f.path(), fifreeze); err != nil {
		if errors.Is(err, unix.EBUSY) {
			return time.Time{}, fmt.Errorf("%s is already frozen (by someone else): %w", f.path(), errdefs.ErrAlreadyExists)
		}
		return time.Time{}, err
	}
	f.until = time.Now().Add(timeout)
	f.timer = time.AfterFunc(timeout, func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		if f.timer == nil {
			return
		}
		f.timer = nil
		err := ioctl(f.path(), fithaw)
		f.logger().Warn("filesystem thawed by its deadline: no thaw arrived", "path", f.path(), "timeout", timeout, "error", err)
	})
	return f.until, nil
}

// Thaw thaws a filesystem this Freezer froze. Thawing one that is not
// frozen is FailedPrecondition.
func (f *Freezer) Thaw() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.timer == nil {
		return fmt.Errorf("%s is not frozen: %w", f.path(), errdefs.ErrFailedPrecondition)
	}
	if err := ioctl(f.path(), fithaw); err != nil && !errors.Is(err, unix.EINVAL) {
		return err
	}
	f.timer.Stop()
	f.timer = nil
	return nil
}

// Frozen reports whether a freeze is held, and until when.
func (f *Freezer) Frozen() (bool, time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.timer != nil, f.until
}

func (f *Freezer) logger() *slog.Logger {
	if f.Log == nil {
		return slog.Default()
	}
	return f.Log
}

func ioctl(path string, req uint) error {
	d, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("open %s: %w", path, err)
	}
	defer d.Close()
	if err := unix.IoctlSetInt(int(d.Fd()), req, 0); err != nil {
		if errors.Is(err, unix.EPERM) || errors.Is(err, unix.EACCES) {
			return fmt.Errorf("freeze %s: %w (needs CAP_SYS_ADMIN, which runc sandboxes do not get: "+
				"pause the sandbox from the host instead): %w", path, err, errdefs.ErrFailedPrecondition)
		}
		if errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOTTY) {
			return fmt.Errorf("freeze %s: %w (filesystem cannot freeze): %w", path, err, errdefs.ErrFailedPrecondition)
		}
		return fmt.Errorf("ioctl %s: %w", path, err)
	}
	return nil
}
