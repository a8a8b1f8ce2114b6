package template

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// root writes into a staging directory without ever following a path out
// of it: every lookup goes through openat2(RESOLVE_IN_ROOT), so an image's
// absolute or ../ symlinks resolve inside staging as they would inside the
// sandbox, and final components are created with *at calls that do not
// follow symlinks.
type root struct {
	fd   int
	path string
}

func openRoot(dir string) (*root, error) {
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("template: open staging: %w", err)
	}
	return &root{fd: fd, path: dir}, nil
}

func (r *root) Close() error { return unix.Close(r.fd) }

func (r *root) openDir(rel string) (int, error) {
	return unix.Openat2(r.fd, rel, &unix.OpenHow{
		Flags:   unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS,
	})
}

// mkdirAll returns an O_PATH fd for directory rel, creating missing
// components 0755 root-owned; a later tar entry for the directory fixes its
// metadata (flattened streams list upper layers first, so a child can
// arrive before its parent).
func (r *root) mkdirAll(rel string) (int, error) {
	return r.mkdirAllDepth(rel, 0)
}

func (r *root) mkdirAllDepth(rel string, depth int) (int, error) {
	if rel == "." || rel == "" {
		return unix.Dup(r.fd)
	}
	if depth > 40 {
		return -1, unix.ELOOP
	}
	fd, err := r.openDir(rel)
	if err == nil || !errors.Is(err, unix.ENOENT) {
		return fd, err
	}
	parent, err := r.mkdirAllDepth(path.Dir(rel), depth+1)
	if err != nil {
		return -1, err
	}
	defer unix.Close(parent)
	base := path.Base(rel)
	if err := unix.Mkdirat(parent, base, 0o755); err != nil && !errors.Is(err, unix.EEXIST) {
		return -1, err
	}
	fd, err = r.openDir(rel)
	if !errors.Is(err, unix.ENOENT) {
		return fd, err
	}
	// A dangling symlink (say usr/local/bin -> /opt/bin): create its
	// target inside the root, as the path would resolve in the sandbox.
	buf := make([]byte, unix.PathMax)
	n, lerr := unix.Readlinkat(parent, base, buf)
	if lerr != nil {
		return -1, err
	}
	target := string(buf[:n])
	if !path.IsAbs(target) {
		target = path.Join("/", path.Dir(rel), target)
	}
	tfd, terr := r.mkdirAllDepth(strings.TrimPrefix(path.Clean(target), "/"), depth+1)
	if terr != nil {
		return -1, terr
	}
	unix.Close(tfd)
	return r.openDir(rel)
}

// entryName turns a tar name into a clean path relative to the root, or
// reports that it leaves the root.
func entryName(name string) (string, error) {
	c := path.Clean(strings.TrimLeft(name, "/"))
	if c == ".." || strings.HasPrefix(c, "../") {
		return "", fmt.Errorf("entry %q escapes the image root", name)
	}
	if c == "." {
		return "", nil
	}
	return c, nil
}

type hardlink struct {
	name, target string
}

// countingReader remembers read-side failures so a broken image is told
// apart from a failing staging disk.
type countingReader struct {
	r   io.Reader
	n   int64
	err error
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	if err != nil && err != io.EOF {
		c.err = err
	}
	return n, err
}

// streamErr classifies a failure reading the flattened stream: what the
// layer readers already classified (a digest mismatch, an unreachable
// registry, a cancelled import) keeps its class; anything else means the
// image is broken.
func streamErr(err error) error {
	for _, kind := range []error{errdefs.ErrInvalidArgument, errdefs.ErrUnavailable, errdefs.ErrUnauthenticated,
		errdefs.ErrPermissionDenied, errdefs.ErrNotFound, errdefs.ErrResourceExhausted, context.Canceled, context.DeadlineExceeded} {
		if errors.Is(err, kind) {
			return fmt.Errorf("template: reading image layers: %w", err)
		}
	}
	return invalid("reading image layers: %v", err)
}

// extractTo writes the flattened image stream into staging.
func extractTo(ctx context.Context, stream io.Reader, staging string) error {
	r, err := openRoot(staging)
	if err != nil {
		return err
	}
	defer r.Close()
	cr := &countingReader{r: stream}
	tr := tar.NewReader(cr)
	var links []hardlink
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return streamErr(err)
		}
		name, err := entryName(h.Name)
		if err != nil {
			return invalid("%v", err)
		}
		if name == "" {
			continue // the root itself: mkfs root_owner sets it
		}
		if h.Typeflag == tar.TypeLink {
			links = append(links, hardlink{name: name, target: path.Clean("/" + h.Linkname)[1:]})
			continue
		}
		if err := r.writeEntry(h, name, tr); err != nil {
			if cr.err != nil {
				return streamErr(cr.err)
			}
			return fmt.Errorf("template: write %s: %w", name, err)
		}
	}
	// Hardlinks last: their target may come from a lower layer, which the
	// flattened stream lists after the link.
	for _, l := range links {
		if err := r.link(l); err != nil {
			slog.WarnContext(ctx, "template: skipping hardlink", "name", l.name, "target", l.target, "err", err)
		}
	}
	return nil
}

func (r *root) writeEntry(h *tar.Header, name string, body io.Reader) error {
	parent, err := r.mkdirAll(path.Dir(name))
	if err != nil {
		return err
	}
	defer unix.Close(parent)
	base := path.Base(name)
	mode := uint32(h.Mode) & 0o7777

	switch h.Typeflag {
	case tar.TypeDir:
		if err := unix.Mkdirat(parent, base, 0o700); err != nil && !errors.Is(err, unix.EEXIST) {
			return err
		}
		fd, err := unix.Openat(parent, base, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			// An upper layer put a non-directory here; it wins.
			return nil
		}
		defer unix.Close(fd)
		return setMeta(fd, h, mode)
	case tar.TypeReg:
		fd, err := unix.Openat(parent, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if errors.Is(err, unix.EEXIST) {
			return nil // shadowed by an upper-layer entry of another type
		}
		if err != nil {
			return err
		}
		f := os.NewFile(uintptr(fd), name)
		defer f.Close()
		if _, err := io.Copy(f, body); err != nil {
			return err
		}
		if err := setMeta(fd, h, mode); err != nil {
			return err
		}
	case tar.TypeSymlink:
		if err := unix.Symlinkat(h.Linkname, parent, base); err != nil {
			if errors.Is(err, unix.EEXIST) {
				return nil
			}
			return err
		}
		if err := unix.Fchownat(parent, base, h.Uid, h.Gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
	case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
		kind := map[byte]uint32{tar.TypeChar: unix.S_IFCHR, tar.TypeBlock: unix.S_IFBLK, tar.TypeFifo: unix.S_IFIFO}[h.Typeflag]
		dev := int(unix.Mkdev(uint32(h.Devmajor), uint32(h.Devminor)))
		if err := unix.Mknodat(parent, base, kind|mode, dev); err != nil {
			if errors.Is(err, unix.EEXIST) || errors.Is(err, unix.EPERM) {
				// EPERM: unprivileged or in a user namespace; the
				// runtime provides /dev anyway.
				return nil
			}
			return err
		}
		if err := unix.Fchownat(parent, base, h.Uid, h.Gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
		if err := unix.Fchmodat(parent, base, mode, 0); err != nil {
			return err
		}
	default:
		return nil // PAX globals and the like carry no file
	}
	ts := []unix.Timespec{unix.NsecToTimespec(h.ModTime.UnixNano()), unix.NsecToTimespec(h.ModTime.UnixNano())}
	if h.AccessTime.After(h.ModTime) {
		ts[0] = unix.NsecToTimespec(h.AccessTime.UnixNano())
	}
	_ = unix.UtimesNanoAt(parent, base, ts, unix.AT_SYMLINK_NOFOLLOW)
	return nil
}

// setMeta chowns before chmod because chown clears setuid/setgid bits.
func setMeta(fd int, h *tar.Header, mode uint32) error {
	if err := unix.Fchown(fd, h.Uid, h.Gid); err != nil {
		return err
	}
	if err := unix.Fchmod(fd, mode); err != nil {
		return err
	}
	for k, v := range h.PAXRecords {
		if attr, ok := strings.CutPrefix(k, "SCHILY.xattr."); ok {
			if err := unix.Fsetxattr(fd, attr, []byte(v), 0); err != nil && !errors.Is(err, unix.ENOTSUP) {
				return fmt.Errorf("xattr %s: %w", attr, err)
			}
		}
	}
	return nil
}

func (r *root) link(l hardlink) error {
	tparent, err := r.openDir(path.Dir(l.target))
	if err != nil {
		return err
	}
	defer unix.Close(tparent)
	parent, err := r.mkdirAll(path.Dir(l.name))
	if err != nil {
		return err
	}
	defer unix.Close(parent)
	err = unix.Linkat(tparent, path.Base(l.target), parent, path.Base(l.name), 0)
	if errors.Is(err, unix.EEXIST) {
		return nil
	}
	return err
}
