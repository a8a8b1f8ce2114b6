// Package netnsdir creates network namespaces pinned as files (bind mounts
// of the nsfs inode) in a directory the caller owns, the way `ip netns`
// pins them under /run/netns, and runs code inside them.
//
// A pinned namespace lives until its file is unmounted AND no process or
// socket holds it; Remove only unpins. Everything here is idempotent, so a
// caller that crashed half-way can simply call again.
//
// Processes that should see the pins (runc, a VM monitor) must share the
// mount namespace of the process that made them, or the directory must be
// a shared mount.
package netnsdir

import (
	"errors"
	"fmt"
	"os"
	"runtime"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
)

const nsfsMagic = 0x6e736673

// IsPinned reports whether path is a pinned network namespace.
func IsPinned(path string) (bool, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return false, nil
		}
		return false, err
	}
	return st.Type == nsfsMagic, nil
}

// Create makes a new network namespace pinned at path. If path already
// pins one, Create returns errdefs.ErrAlreadyExists and leaves it alone;
// an unpinned file left by a crash is reused.
func Create(path string) error {
	if ok, err := IsPinned(path); err != nil {
		return err
	} else if ok {
		return fmt.Errorf("netns %s: %w", path, ErrExists)
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDONLY, 0o444)
	if err != nil {
		return fmt.Errorf("netns pin file: %w", err)
	}
	f.Close()
	errc := make(chan error, 1)
	// A fresh goroutine owns the thread that unshares: if switching back
	// fails it exits still locked, and the runtime kills the thread
	// instead of reusing it in the wrong namespace.
	go func() {
		runtime.LockOSThread()
		orig, err := os.Open(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()))
		if err != nil {
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		defer orig.Close()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("unshare: %w", err)
			return
		}
		merr := unix.Mount(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()), path, "none", unix.MS_BIND, "")
		if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("restore netns: %w", err)
			return
		}
		runtime.UnlockOSThread()
		if merr != nil {
			merr = fmt.Errorf("pin netns at %s: %w", path, merr)
		}
		errc <- merr
	}()
	if err := <-errc; err != nil {
		_ = os.Remove(path)
		return err
	}
	return nil
}

// Remove unpins the namespace at path and removes the file. A missing
// file is not an error.
func Remove(path string) error {
	if err := unix.Unmount(path, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("unpin netns %s: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove netns file: %w", err)
	}
	return nil
}

// Do runs fn on an OS thread that has joined the namespace at path. fn
// must not start goroutines that need to be in the namespace: only the
// calling thread is.
func Do(path string, fn func() error) error {
	target, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("open netns: %w", err)
	}
	defer target.Close()
	if ok, err := IsPinned(path); err != nil || !ok {
		if err == nil {
			err = fmt.Errorf("%s is not a network namespace: %w", path, errdefs.ErrNotFound)
		}
		return err
	}
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := os.Open(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()))
		if err != nil {
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		defer orig.Close()
		if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("setns %s: %w", path, err)
			return
		}
		ferr := fn()
		if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err != nil {
			errc <- errors.Join(ferr, fmt.Errorf("restore netns: %w", err))
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

// Sysctl writes value to a /proc/sys/net key (e.g. "ipv4/ip_forward") of
// the namespace at path. The namespace a /proc/sys/net file belongs to is
// the opening thread's, hence Do.
func Sysctl(path string, kv ...string) error {
	return Do(path, func() error {
		for i := 0; i+1 < len(kv); i += 2 {
			if err := os.WriteFile("/proc/sys/net/"+kv[i], []byte(kv[i+1]), 0o644); err != nil {
				return fmt.Errorf("sysctl net/%s: %w", kv[i], err)
			}
		}
		return nil
	})
}

// Inode returns the namespace inode of a pinned file or /proc/<pid>/ns/net,
// to compare which namespace a process is in.
func Inode(path string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, err
	}
	return st.Ino, nil
}

// ErrExists is returned by Create when a namespace is already pinned at
// the path; it wraps errdefs.ErrAlreadyExists.
var ErrExists = fmt.Errorf("namespace already pinned: %w", errdefs.ErrAlreadyExists)
