// Package template turns an OCI image into a sandbox template: a raw ext4
// image holding the flattened rootfs with cube-agent injected.
//
// Import runs these phases, each reported through the progress callback:
//
//	resolve  read the source (OCI layout dir, docker-archive tar, OCI-archive tar)
//	extract  flatten all layers (whiteouts applied) into a staging dir
//	inject   add /usr/local/bin/cube-agent and the files runtimes bind over
//	mkfs     mkfs.ext4 -d staging into a temp file, renamed onto Output
//	done
//
// Staging lives in a private directory under WorkDir that is removed on
// every return path; Output is either untouched or completely written.
package template

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strconv"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// AgentPath is where the agent lands inside every template.
const AgentPath = "/usr/local/bin/cube-agent"

const (
	defaultHeadroomMiB = 64
	minImageBytes      = 64 << 20
	blockSize          = 4096
)

// ImportRequest describes one template import.
type ImportRequest struct {
	Source      string // OCI image layout dir, or OCI-archive / docker-archive tar file
	AgentBinary string // static cube-agent, injected at AgentPath mode 0755
	HeadroomMiB int64  // free space left in the image; default 64
	Output      string // ext4 raw image to write (replaced atomically)
	WorkDir     string // scratch space; default the directory of Output
}

// Meta is what the runtime needs from the image config.
type Meta struct {
	Digest          string // manifest digest of the imported image
	Entrypoint, Cmd []string
	Env             []string
	WorkingDir      string
	User            string
	SizeBytes       int64 // apparent size of the written ext4 image
}

// Progress reports where an import is. Phases are resolve, extract,
// inject, mkfs and done. During extract, Layer counts layers opened so far
// (the flattener walks from the top layer down) and Bytes counts
// uncompressed bytes read; Total is 0 because the uncompressed size is not
// known up front.
type Progress struct {
	Phase         string
	Layer, Layers int
	Bytes, Total  int64
}

// Import writes req.Output from req.Source. A source that cannot be read as
// an image yields errdefs.ErrInvalidArgument.
func Import(ctx context.Context, req ImportRequest, progress func(Progress)) (meta Meta, err error) {
	if progress == nil {
		progress = func(Progress) {}
	}
	if req.Source == "" || req.Output == "" || req.AgentBinary == "" {
		return Meta{}, invalid("Source, Output and AgentBinary are required")
	}
	if st, err := os.Stat(req.AgentBinary); err != nil || !st.Mode().IsRegular() {
		return Meta{}, invalid("agent binary %s is not a regular file", req.AgentBinary)
	}
	headroom := req.HeadroomMiB
	if headroom <= 0 {
		headroom = defaultHeadroomMiB
	}
	workDir := req.WorkDir
	if workDir == "" {
		workDir = filepath.Dir(req.Output)
	}
	if err := os.MkdirAll(workDir, 0o755); err != nil {
		return Meta{}, fmt.Errorf("template: work dir: %w", err)
	}
	scratch, err := os.MkdirTemp(workDir, ".import-*")
	if err != nil {
		return Meta{}, fmt.Errorf("template: scratch dir: %w", err)
	}
	defer func() {
		if rerr := os.RemoveAll(scratch); rerr != nil && err == nil {
			err = fmt.Errorf("template: remove scratch: %w", rerr)
		}
	}()
	log := slog.With("source", req.Source, "output", req.Output)

	progress(Progress{Phase: "resolve"})
	img, err := openSource(req.Source, scratch)
	if err != nil {
		return Meta{}, err
	}
	digest, err := img.Digest()
	if err != nil {
		return Meta{}, invalid("image digest: %v", err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return Meta{}, invalid("image config: %v", err)
	}
	layers, err := img.Layers()
	if err != nil {
		return Meta{}, invalid("image layers: %v", err)
	}
	meta = Meta{
		Digest:     digest.String(),
		Entrypoint: cf.Config.Entrypoint,
		Cmd:        cf.Config.Cmd,
		Env:        cf.Config.Env,
		WorkingDir: cf.Config.WorkingDir,
		User:       cf.Config.User,
	}

	staging := filepath.Join(scratch, "rootfs")
	if err := os.Mkdir(staging, 0o755); err != nil {
		return Meta{}, fmt.Errorf("template: staging: %w", err)
	}
	n := len(layers)
	opened := 0
	progress(Progress{Phase: "extract", Layers: n})
	pimg := &progressImage{Image: img, opened: func() {
		opened++
		progress(Progress{Phase: "extract", Layer: opened, Layers: n})
	}}
	stream := mutate.Extract(pimg)
	err = extractTo(ctx, stream, staging, func(b int64) {
		progress(Progress{Phase: "extract", Layer: opened, Layers: n, Bytes: b})
	})
	// Closing the pipe stops the flattening goroutine if we bailed early.
	_ = stream.Close()
	if err != nil {
		return Meta{}, err
	}

	progress(Progress{Phase: "inject"})
	if err := prepareRootfs(staging, req.AgentBinary); err != nil {
		return Meta{}, err
	}

	progress(Progress{Phase: "mkfs"})
	used, inodes, err := measure(staging)
	if err != nil {
		return Meta{}, err
	}
	size := imageSize(used, inodes, headroom)
	if size, err = writeExt4(ctx, staging, req.Output, size, inodes, log); err != nil {
		return Meta{}, err
	}
	meta.SizeBytes = size
	log.Info("template imported", "digest", meta.Digest, "size_bytes", size, "layers", n)
	progress(Progress{Phase: "done", Layer: n, Layers: n})
	return meta, nil
}

type progressImage struct {
	v1.Image
	opened func()
}

func (p *progressImage) Layers() ([]v1.Layer, error) {
	ls, err := p.Image.Layers()
	if err != nil {
		return nil, err
	}
	out := make([]v1.Layer, len(ls))
	for i, l := range ls {
		out[i] = &progressLayer{Layer: l, opened: p.opened}
	}
	return out, nil
}

type progressLayer struct {
	v1.Layer
	opened func()
}

func (l *progressLayer) Uncompressed() (io.ReadCloser, error) {
	l.opened()
	return l.Layer.Uncompressed()
}

// prepareRootfs injects the agent and creates what every runtime expects
// to mount or bind over, so it never has to write into a read-only image.
func prepareRootfs(staging, agent string) error {
	r, err := openRoot(staging)
	if err != nil {
		return err
	}
	defer r.Close()
	for _, d := range []struct {
		name string
		mode uint32
	}{{"proc", 0o555}, {"sys", 0o555}, {"dev", 0o755}, {"tmp", 0o1777}, {"run", 0o755}, {"etc", 0o755}} {
		var st unix.Stat_t
		if unix.Fstatat(r.fd, d.name, &st, unix.AT_SYMLINK_NOFOLLOW) != nil {
			if err := unix.Mkdirat(r.fd, d.name, d.mode); err != nil && !errors.Is(err, unix.EEXIST) {
				return fmt.Errorf("template: create /%s: %w", d.name, err)
			}
			// Mkdirat applies the umask; the sticky /tmp must be exact.
			_ = unix.Fchmodat(r.fd, d.name, d.mode, 0)
		}
		// mkdirAll also materialises a dangling symlink's target in-root.
		fd, err := r.mkdirAll(d.name)
		if err != nil {
			return invalid("image /%s is not usable as a directory: %v", d.name, err)
		}
		unix.Close(fd)
	}
	etc, err := r.openDir("etc")
	if err != nil {
		return fmt.Errorf("template: /etc: %w", err)
	}
	defer unix.Close(etc)
	for _, f := range []string{"hosts", "resolv.conf", "hostname"} {
		// Lstat semantics: an image's symlink (resolv.conf -> ../run/...)
		// counts as present; the runtime binds over it.
		var st unix.Stat_t
		if err := unix.Fstatat(etc, f, &st, unix.AT_SYMLINK_NOFOLLOW); err == nil {
			continue
		}
		fd, err := unix.Openat(etc, f, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o644)
		if err != nil {
			return fmt.Errorf("template: create /etc/%s: %w", f, err)
		}
		unix.Close(fd)
	}
	return injectAgent(r, agent)
}

func injectAgent(r *root, agent string) error {
	rel := strings.TrimPrefix(AgentPath, "/")
	parent, err := r.mkdirAll(path.Dir(rel))
	if err != nil {
		return fmt.Errorf("template: agent dir: %w", err)
	}
	defer unix.Close(parent)
	base := path.Base(rel)
	// Whatever the image had there (file or symlink) is replaced.
	if err := unix.Unlinkat(parent, base, 0); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("template: replace %s: %w", AgentPath, err)
	}
	src, err := os.Open(agent)
	if err != nil {
		return fmt.Errorf("template: agent: %w", err)
	}
	defer src.Close()
	fd, err := unix.Openat(parent, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o755)
	if err != nil {
		return fmt.Errorf("template: create %s: %w", AgentPath, err)
	}
	dst := os.NewFile(uintptr(fd), AgentPath)
	_, cerr := io.Copy(dst, src)
	err = errors.Join(cerr, unix.Fchown(fd, 0, 0), unix.Fchmod(fd, 0o755), dst.Close())
	if err != nil {
		return fmt.Errorf("template: write %s: %w", AgentPath, err)
	}
	return nil
}

// measure sums what the files will take in ext4 (apparent sizes rounded up
// to blocks, one block per directory and long symlink) and counts inodes.
func measure(staging string) (used, inodes int64, err error) {
	err = filepath.WalkDir(staging, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		inodes++
		info, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case info.Mode().IsRegular():
			used += (info.Size() + blockSize - 1) / blockSize * blockSize
		case info.IsDir():
			used += blockSize
		case info.Mode()&os.ModeSymlink != 0 && info.Size() >= 60:
			used += blockSize // longer targets do not fit in the inode
		}
		return nil
	})
	if err != nil {
		return 0, 0, fmt.Errorf("template: measure staging: %w", err)
	}
	return used, inodes, nil
}

// imageSize adds ext4 overhead (inode tables, bitmaps, journal: ~10% plus
// a fixed 16 MiB) and the requested headroom, rounded up to a MiB.
func imageSize(used, inodes, headroomMiB int64) int64 {
	size := used + used/10 + 16<<20 + inodeCount(used, inodes)*256 + headroomMiB<<20
	size = (size + 1<<20 - 1) &^ (1<<20 - 1)
	return max(size, minImageBytes)
}

// inodeCount keeps mke2fs's default ratio (one per 16 KiB) but never fewer
// than the files present plus room to grow: images full of tiny files
// (node_modules) would otherwise run out of inodes before space.
func inodeCount(used, inodes int64) int64 {
	return max(used/16384, inodes+inodes/2+4096)
}

// writeExt4 formats a temp file next to output and renames it into place.
//
// The journal stays on: a sandbox disk is cloned while its sandbox may be
// running (snapshot after freeze) and survives host crashes, and a journal
// is what makes those clones and the original mountable without fsck. Inode
// tables and the journal are zeroed now (lazy_*_init=0) so that the first
// mount of each clone does not rewrite them and unshare its reflinked
// blocks. -m 0: the headroom is for the sandbox, not for reserved blocks.
func writeExt4(ctx context.Context, staging, output string, size, inodes int64, log *slog.Logger) (int64, error) {
	if err := os.MkdirAll(filepath.Dir(output), 0o755); err != nil {
		return 0, fmt.Errorf("template: output dir: %w", err)
	}
	f, err := os.CreateTemp(filepath.Dir(output), "."+filepath.Base(output)+".*.tmp")
	if err != nil {
		return 0, fmt.Errorf("template: output: %w", err)
	}
	tmp := f.Name()
	_ = f.Close()
	done := false
	defer func() {
		if !done {
			_ = os.Remove(tmp)
		}
	}()
	used := size - 16<<20
	for attempt := 0; ; attempt++ {
		if err := os.Truncate(tmp, size); err != nil {
			return 0, fmt.Errorf("template: size output: %w", err)
		}
		args := []string{"-q", "-F", "-b", strconv.Itoa(blockSize), "-m", "0",
			"-N", strconv.FormatInt(inodeCount(used, inodes), 10),
			"-L", "cube-rootfs",
			"-E", "root_owner=0:0,lazy_itable_init=0,lazy_journal_init=0",
			"-d", staging, tmp}
		out, err := exec.CommandContext(ctx, "mkfs.ext4", args...).CombinedOutput()
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return 0, ctx.Err()
		}
		msg := strings.TrimSpace(string(out))
		// The estimate can fall short for odd trees; one bigger retry is
		// cheaper than a perfect model of ext4 metadata.
		if attempt == 0 && (strings.Contains(msg, "space") || strings.Contains(msg, "allocate")) {
			log.Warn("mkfs.ext4 ran out of space; retrying larger", "size_bytes", size, "err", msg)
			size += size / 2
			if err := os.Truncate(tmp, 0); err != nil {
				return 0, fmt.Errorf("template: reset output: %w", err)
			}
			continue
		}
		return 0, fmt.Errorf("template: mkfs.ext4: %w: %s: %w", err, msg, errdefs.ErrInternal)
	}
	if err := syncPath(tmp); err != nil {
		return 0, err
	}
	if err := os.Rename(tmp, output); err != nil {
		return 0, fmt.Errorf("template: install output: %w", err)
	}
	done = true
	return size, syncPath(filepath.Dir(output))
}

func syncPath(p string) error {
	f, err := os.Open(p)
	if err != nil {
		return fmt.Errorf("template: sync %s: %w", p, err)
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		return fmt.Errorf("template: sync %s: %w", p, err)
	}
	return nil
}
