// Package hostbind binds a host path into a sandbox by file descriptor, so
// that what is bound is what was checked.
//
// Binding a host path by name lets whoever can write one of its parent
// directories (another sandbox with a read-write bind there, a host user)
// swap a component for a symlink between the check and the bind, and the
// bind then follows it anywhere on the host. Stage instead opens the
// source once, without following any symlink and without leaving the
// allow rule's prefix (openat2 RESOLVE_NO_SYMLINKS|RESOLVE_BENEATH),
// checks the object that file descriptor names, clones its mount tree
// from the descriptor (open_tree OPEN_TREE_CLONE), sets nosuid and nodev
// (and read-only, recursively, for a read-only bind) on the clone
// (mount_setattr AT_RECURSIVE), and attaches it at a staging path
// (move_mount). The runtime binds the staging path by name, in its own
// process; the staging path lies in a directory only root can write, so
// nothing a tenant controls can redirect that second bind. A swap after
// the open changes nothing: the clone is of the object already open.
//
// Unstage removes the staging mounts; the runtime's own copy in the
// sandbox's mount namespace is independent of them, so they are removed
// as soon as the sandbox has started.
package hostbind

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
)

// Failpoints between the steps of Stage: a test changes the source there.
const (
	// FailpointOpen: the caller's checks by name are done; the source is
	// opened next.
	FailpointOpen = "hostbind/open"
	// FailpointOpened: the source is open, nothing checked yet.
	FailpointOpened = "hostbind/opened"
	// FailpointChecked: the open source is checked, not yet cloned.
	FailpointChecked = "hostbind/checked"
	// FailpointStaged: the clone is at the staging path; the runtime
	// binds it next.
	FailpointStaged = "hostbind/staged"
)

// Request is one host path to stage.
type Request struct {
	// Root is the allow rule's prefix (absolute, without symlinks) that
	// Source must lie beneath.
	Root string
	// Source is the host path (absolute, without symlinks).
	Source string
	// Target is the staging path to create and mount on. Its directory
	// must exist and be writable by root alone.
	Target   string
	ReadOnly bool
	// Check validates the path the opened source has (as the kernel names
	// it) against the allow rules, with ReadOnly's access.
	Check func(path string) error
}

// resolveFlags refuse every symlink (the caller's Source is already
// resolved, so a symlink in it is a swap) and any step out of Root.
const resolveFlags = unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS

// Stage opens r.Source by descriptor and mounts a private, recursive clone
// of it on r.Target with nosuid and nodev, read-only at every level when
// r.ReadOnly. A source that is not what was checked (a symlink, out of
// Root, moved out of the allowed prefixes, neither directory nor regular
// file, a file with other hard links) is refused with
// errdefs.ErrFailedPrecondition. On failure nothing is left at r.Target.
func Stage(ctx context.Context, r Request) error {
	if !filepath.IsAbs(r.Root) || !filepath.IsAbs(r.Source) || !filepath.IsAbs(r.Target) || r.Check == nil {
		return fmt.Errorf("hostbind: bad request %+v: %w", r, errdefs.ErrInvalidArgument)
	}
	rel, err := filepath.Rel(r.Root, r.Source)
	if err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
		return fmt.Errorf("hostbind: %s is not beneath %s: %w", r.Source, r.Root, errdefs.ErrFailedPrecondition)
	}
	if err := failpoint.Eval(ctx, FailpointOpen); err != nil {
		return err
	}
	fd, err := openSource(r.Root, rel)
	if err != nil {
		return fmt.Errorf("hostbind: open %s: %w", r.Source, err)
	}
	defer unix.Close(fd)
	if err := failpoint.Eval(ctx, FailpointOpened); err != nil {
		return err
	}
	isDir, err := checkOpened(fd, r)
	if err != nil {
		return fmt.Errorf("hostbind: %s: %w", r.Source, err)
	}
	if err := failpoint.Eval(ctx, FailpointChecked); err != nil {
		return err
	}
	if err := mountClone(fd, r, isDir); err != nil {
		return fmt.Errorf("hostbind: %s on %s: %w", r.Source, r.Target, err)
	}
	if err := failpoint.Eval(ctx, FailpointStaged); err != nil {
		return errors.Join(err, unstageOne(r.Target))
	}
	return nil
}

// openSource opens rel beneath root as an O_PATH descriptor, following
// no symlink at any step (root's own components included).
func openSource(root, rel string) (int, error) {
	rootFD, err := openat2(unix.AT_FDCWD, root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, resolveFlags)
	if err != nil {
		return -1, refused("allow prefix "+root, err)
	}
	defer unix.Close(rootFD)
	fd, err := openat2(rootFD, rel, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, resolveFlags|unix.RESOLVE_BENEATH)
	if err != nil {
		return -1, refused("source", err)
	}
	return fd, nil
}

// openat2 retries EAGAIN, which the kernel returns when a rename or mount
// raced a RESOLVE_BENEATH walk.
func openat2(dirfd int, path string, flags int, resolve uint64) (int, error) {
	how := &unix.OpenHow{Flags: uint64(flags), Resolve: resolve}
	for range 8 {
		fd, err := unix.Openat2(dirfd, path, how)
		if !errors.Is(err, unix.EAGAIN) {
			return fd, err
		}
	}
	return -1, unix.EAGAIN
}

// refused turns the errors of a resolution the swap defences stopped into
// FailedPrecondition with the reason.
func refused(what string, err error) error {
	switch {
	case errors.Is(err, unix.ELOOP):
		return fmt.Errorf("%s: a path component is a symlink (%w): %w", what, err, errdefs.ErrFailedPrecondition)
	case errors.Is(err, unix.EXDEV):
		return fmt.Errorf("%s: resolution left the allowed prefix (%w): %w", what, err, errdefs.ErrFailedPrecondition)
	case errors.Is(err, unix.ENOENT), errors.Is(err, unix.ENOTDIR):
		return fmt.Errorf("%s: %w: %w", what, err, errdefs.ErrFailedPrecondition)
	}
	return fmt.Errorf("%s: %w", what, err)
}

// checkOpened checks the object fd names: its kind, its links, and the
// path the kernel gives it now, which must still name this very object
// (no symlink on the way) and pass r.Check.
func checkOpened(fd int, r Request) (isDir bool, err error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return false, err
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		isDir = true
	case unix.S_IFREG:
		// Another name of the same file may lie anywhere on its
		// filesystem (a hard link to /etc/shadow planted in an allowed
		// directory), and only the opened name is checked.
		if st.Nlink > 1 {
			return false, fmt.Errorf("a regular file with %d hard links: %w", st.Nlink, errdefs.ErrFailedPrecondition)
		}
	case unix.S_IFLNK: // O_PATH|O_NOFOLLOW opens a final symlink itself
		return false, fmt.Errorf("the source is a symlink: %w", errdefs.ErrFailedPrecondition)
	default:
		return false, fmt.Errorf("neither a directory nor a regular file: %w", errdefs.ErrFailedPrecondition)
	}
	now, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	if err != nil {
		return false, err
	}
	// A removed source reads "<path> (deleted)", which names nothing or
	// something else: the identity check refuses it.
	again, err := openat2(unix.AT_FDCWD, now, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, resolveFlags)
	if err != nil {
		return false, refused("source now at "+now, err)
	}
	var st2 unix.Stat_t
	err = unix.Fstat(again, &st2)
	_ = unix.Close(again)
	if err != nil {
		return false, err
	}
	if st.Dev != st2.Dev || st.Ino != st2.Ino {
		return false, fmt.Errorf("source moved while opened (%s names another object now): %w", now, errdefs.ErrFailedPrecondition)
	}
	if err := r.Check(now); err != nil {
		return false, fmt.Errorf("source now at %s: %v: %w", now, err, errdefs.ErrFailedPrecondition)
	}
	return isDir, nil
}

// mountClone clones the mount tree at fd, sets its attributes and moves
// it onto r.Target (created here, removed again on failure).
func mountClone(fd int, r Request, isDir bool) error {
	tree, err := unix.OpenTree(fd, "", unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_EMPTY_PATH|unix.AT_RECURSIVE)
	if err != nil {
		return fmt.Errorf("open_tree: %w", err)
	}
	defer unix.Close(tree)
	// Private: mounts and unmounts under the source on the host do not
	// follow the clone into the sandbox, nor the other way.
	attr := &unix.MountAttr{Attr_set: unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV, Propagation: unix.MS_PRIVATE}
	if r.ReadOnly {
		attr.Attr_set |= unix.MOUNT_ATTR_RDONLY
	}
	if err := unix.MountSetattr(tree, "", unix.AT_EMPTY_PATH|unix.AT_RECURSIVE, attr); err != nil {
		return fmt.Errorf("mount_setattr: %w", err)
	}
	if isDir {
		err = os.Mkdir(r.Target, 0o700)
	} else {
		var f *os.File
		if f, err = os.OpenFile(r.Target, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600); err == nil {
			err = f.Close()
		}
	}
	if err != nil {
		return fmt.Errorf("staging path: %w", err)
	}
	if err := unix.MoveMount(tree, "", unix.AT_FDCWD, r.Target, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		_ = os.Remove(r.Target)
		return fmt.Errorf("move_mount: %w", err)
	}
	return nil
}

// Unstage unmounts and removes every staging path in dir, then dir. A dir
// that does not exist is not an error. It never removes recursively: a
// staging mount still there would expose the host directory's files.
func Unstage(dir string) error {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	} else if err != nil {
		return fmt.Errorf("hostbind: %w", err)
	}
	var errs []error
	for _, e := range ents {
		if err := unstageOne(filepath.Join(dir, e.Name())); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if err := os.Remove(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("hostbind: %w", err)
	}
	return nil
}

// unstageOne unmounts every mount stacked on p and removes p. A plain
// unmount (about 1 ms) before a lazy one (about 2 ms): nothing but a
// runtime still starting holds a staging mount.
func unstageOne(p string) error {
	for range 16 {
		err := unix.Unmount(p, unix.UMOUNT_NOFOLLOW)
		if errors.Is(err, unix.EBUSY) {
			err = unix.Unmount(p, unix.MNT_DETACH|unix.UMOUNT_NOFOLLOW)
		}
		if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
			break // not (or no longer) a mount point
		}
		if err != nil {
			return fmt.Errorf("hostbind: unmount %s: %w", p, err)
		}
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("hostbind: %w", err)
	}
	return nil
}
