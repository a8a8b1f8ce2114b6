package storage

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// validID keeps IDs from naming anything outside their own directory.
var validID = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$`)

// ValidateID reports ErrInvalidArgument for template or sandbox IDs that
// could not safely be used as one path element. The path helpers do not
// check; callers validate IDs where they enter the system.
func ValidateID(id string) error {
	if !validID.MatchString(id) || id == "." || id == ".." {
		return fmt.Errorf("storage: invalid id %q: %w", id, errdefs.ErrInvalidArgument)
	}
	return nil
}

// TemplateImagePath is where template import writes a template's rootfs image.
func (p *Pool) TemplateImagePath(templateID string) string {
	return filepath.Join(p.dir, "templates", templateID, "rootfs.img")
}

// SandboxDir holds everything the pool keeps for one sandbox.
func (p *Pool) SandboxDir(sandboxID string) string {
	return filepath.Join(p.dir, "sandboxes", sandboxID)
}

// SandboxDiskPath is the sandbox's writable disk, a clone of its template.
func (p *Pool) SandboxDiskPath(sandboxID string) string {
	return filepath.Join(p.SandboxDir(sandboxID), "disk.img")
}

// RemoveSandboxDisk deletes the sandbox's pool directory; removing what is
// not there is not an error.
func (p *Pool) RemoveSandboxDisk(sandboxID string) error {
	if err := ValidateID(sandboxID); err != nil {
		return err
	}
	if err := os.RemoveAll(p.SandboxDir(sandboxID)); err != nil {
		return fmt.Errorf("storage: remove sandbox %s disk: %w", sandboxID, err)
	}
	return nil
}

// Clone makes dst a copy-on-write clone of src (in copy mode, a sparse
// copy). dst must not exist (ErrAlreadyExists); its parent directories are
// created. On any failure dst is removed. Both must be inside the pool for
// reflink to work.
func (p *Pool) Clone(ctx context.Context, src, dst string) (err error) {
	if err := ctx.Err(); err != nil {
		return err
	}
	in, err := os.Open(src)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("storage: clone source %s: %w", src, errdefs.ErrNotFound)
		}
		return fmt.Errorf("storage: clone source: %w", err)
	}
	defer in.Close()
	st, err := in.Stat()
	if err != nil {
		return fmt.Errorf("storage: clone source: %w", err)
	}
	if !st.Mode().IsRegular() {
		return fmt.Errorf("storage: clone source %s is not a regular file: %w", src, errdefs.ErrInvalidArgument)
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return fmt.Errorf("storage: clone: %w", err)
	}
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_CLOEXEC, st.Mode().Perm())
	if err != nil {
		if errors.Is(err, os.ErrExist) {
			return fmt.Errorf("storage: clone destination %s: %w", dst, errdefs.ErrAlreadyExists)
		}
		return fmt.Errorf("storage: clone destination: %w", err)
	}
	defer func() {
		if cerr := out.Close(); err == nil && cerr != nil {
			err = fmt.Errorf("storage: clone: %w", cerr)
		}
		if err != nil {
			_ = os.Remove(dst)
		}
	}()

	if p.mode == ModeCopy {
		return sparseCopy(ctx, out, in, st.Size())
	}
	if err := unix.IoctlFileClone(int(out.Fd()), int(in.Fd())); err != nil {
		if errors.Is(err, unix.EXDEV) {
			return fmt.Errorf("storage: clone %s -> %s crosses filesystems (both must be in the pool): %w", src, dst, errdefs.ErrInvalidArgument)
		}
		return fmt.Errorf("storage: FICLONE %s -> %s: %w", src, dst, err)
	}
	return nil
}

// sparseCopy copies only the data extents (SEEK_DATA/SEEK_HOLE) so a mostly
// empty disk image stays mostly unallocated in copy mode.
func sparseCopy(ctx context.Context, dst, src *os.File, size int64) error {
	sfd, dfd := int(src.Fd()), int(dst.Fd())
	var off int64
	for off < size {
		if err := ctx.Err(); err != nil {
			return err
		}
		data, err := unix.Seek(sfd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole remains
		}
		if err != nil {
			return fmt.Errorf("storage: copy: SEEK_DATA: %w", err)
		}
		hole, err := unix.Seek(sfd, data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("storage: copy: SEEK_HOLE: %w", err)
		}
		for pos := data; pos < hole; {
			roff, woff := pos, pos
			n, err := unix.CopyFileRange(sfd, &roff, dfd, &woff, int(min(hole-pos, 1<<30)), 0)
			if err != nil {
				return fmt.Errorf("storage: copy_file_range: %w", err)
			}
			if n == 0 {
				return fmt.Errorf("storage: copy: source shrank: %w", io.ErrUnexpectedEOF)
			}
			pos += int64(n)
		}
		off = hole
	}
	if err := dst.Truncate(size); err != nil {
		return fmt.Errorf("storage: copy: %w", err)
	}
	return nil
}

// SpaceUsed is the space path really occupies (st_blocks*512), which for a
// reflinked or sparse file is far less than its apparent size.
func SpaceUsed(path string) (int64, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return 0, fmt.Errorf("storage: %s: %w", path, errdefs.ErrNotFound)
		}
		return 0, fmt.Errorf("storage: stat %s: %w", path, err)
	}
	return st.Blocks * 512, nil
}
