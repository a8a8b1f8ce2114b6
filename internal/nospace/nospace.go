// Package nospace recognises a full filesystem in an error and says which
// one: Wrap turns ENOSPC or EDQUOT, from a syscall or from a child process
// that reported it (runc, mkfs, QEMU print strerror on stderr), into an
// errdefs.ErrNoSpace whose message names the filesystem's mount point, its
// type and its free space. Daemons wrap where they know their directories,
// so a client reads which disk an operator must free, not a bare errno.
package nospace

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// texts are how the errnos read once a child process or a library has
// turned them into text: strerror(ENOSPC), strerror(EDQUOT) and SQLite's
// SQLITE_FULL.
var texts = []string{"no space left on device", "disk quota exceeded", "database or disk is full"}

// Is reports whether err says a filesystem is full: ENOSPC or EDQUOT in
// its chain, an ErrNoSpace, or one of their texts in its message.
func Is(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) || errors.Is(err, errdefs.ErrNoSpace) {
		return true
	}
	msg := strings.ToLower(err.Error())
	for _, t := range texts {
		if strings.Contains(msg, t) {
			return true
		}
	}
	return false
}

// FS is a filesystem at the time of the error.
type FS struct {
	Mount string // its mount point
	Type  string // xfs, ext4, tmpfs, ... (hex magic when unknown)
	Free  uint64 // bytes an unprivileged writer can still use
	Size  uint64 // bytes
	Inode bool   // out of inodes rather than blocks
}

func (f FS) String() string {
	s := fmt.Sprintf("%s (%s) has %s of %s free", f.Mount, f.Type, human(f.Free), human(f.Size))
	if f.Inode {
		s += " and no free inodes"
	}
	return s
}

// Error is a full filesystem: the failure, and the filesystems it names
// (the one the failing call wrote to when the error says, else those of the
// daemon's directories that are full or nearly).
type Error struct {
	Err error
	FS  []FS
}

func (e *Error) Error() string {
	if len(e.FS) == 0 {
		return e.Err.Error() + " (filesystem full)"
	}
	parts := make([]string, len(e.FS))
	for i, f := range e.FS {
		parts[i] = f.String()
	}
	return fmt.Sprintf("%v (filesystem full: %s)", e.Err, strings.Join(parts, "; "))
}

// Unwrap makes an Error both what it wraps and an ErrNoSpace.
func (e *Error) Unwrap() []error { return []error{e.Err, errdefs.ErrNoSpace} }

// Wrap returns err as an *Error when Is(err), else err unchanged (nil
// stays nil; an error Wrap already made passes unchanged). The filesystem
// named is the path's in a *fs.PathError or *os.LinkError in the chain;
// without one, those of dirs (the daemon's data and run directories) that
// are full or nearly; without either, every dir's, so the message always
// shows where space is short.
func Wrap(err error, dirs ...string) error {
	if !Is(err) {
		return err
	}
	var done *Error
	if errors.As(err, &done) {
		return err
	}
	e := &Error{Err: err}
	if p := pathOf(err); p != "" {
		if f, ok := statFS(p); ok {
			e.FS = append(e.FS, f)
			return e
		}
	}
	var all []FS
	seen := map[string]bool{}
	for _, d := range dirs {
		f, ok := statFS(d)
		if !ok || seen[f.Mount] {
			continue
		}
		seen[f.Mount] = true
		all = append(all, f)
		if nearlyFull(f) {
			e.FS = append(e.FS, f)
		}
	}
	if len(e.FS) == 0 {
		e.FS = all
	}
	return e
}

// nearlyFull: under 1% or 4 MiB free, or no inodes. Not zero: XFS and
// ext4 keep blocks back (reservations, root's share) that a failing write
// could not use although statfs counts some of them.
func nearlyFull(f FS) bool {
	limit := f.Size / 100
	if limit < 4<<20 {
		limit = 4 << 20
	}
	return f.Inode || f.Free < limit
}

func pathOf(err error) string {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Path
	}
	var le *os.LinkError
	if errors.As(err, &le) {
		return le.New
	}
	return ""
}

// statFS describes the filesystem holding path (or its nearest existing
// ancestor: the failing call may have been creating it).
func statFS(path string) (FS, bool) {
	p := filepath.Clean(path)
	var st unix.Stat_t
	for unix.Stat(p, &st) != nil {
		parent := filepath.Dir(p)
		if parent == p {
			return FS{}, false
		}
		p = parent
	}
	var sfs unix.Statfs_t
	if unix.Statfs(p, &sfs) != nil {
		return FS{}, false
	}
	return FS{
		Mount: mountPoint(p, st.Dev),
		Type:  fsType(sfs.Type),
		Free:  sfs.Bavail * uint64(sfs.Bsize),
		Size:  sfs.Blocks * uint64(sfs.Bsize),
		Inode: sfs.Files > 0 && sfs.Ffree == 0,
	}, true
}

// mountPoint climbs from p while the parent is on the same device.
func mountPoint(p string, dev uint64) string {
	if !filepath.IsAbs(p) {
		if abs, err := filepath.Abs(p); err == nil {
			p = abs
		}
	}
	for {
		parent := filepath.Dir(p)
		if parent == p {
			return p
		}
		var st unix.Stat_t
		if unix.Stat(parent, &st) != nil || st.Dev != dev {
			return p
		}
		p = parent
	}
}

func fsType(magic int64) string {
	switch magic {
	case unix.XFS_SUPER_MAGIC:
		return "xfs"
	case unix.EXT4_SUPER_MAGIC:
		return "ext4"
	case unix.TMPFS_MAGIC:
		return "tmpfs"
	case unix.BTRFS_SUPER_MAGIC:
		return "btrfs"
	case unix.OVERLAYFS_SUPER_MAGIC:
		return "overlay"
	}
	return fmt.Sprintf("0x%x", magic)
}

func human(b uint64) string {
	switch {
	case b >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(b)/(1<<30))
	case b >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20))
	case b >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(b)/(1<<10))
	}
	return fmt.Sprintf("%d B", b)
}
