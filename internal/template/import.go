// Package template turns an OCI image into a sandbox template: a raw ext4
// image holding the flattened rootfs with cube-agent injected.
//
// Import runs these phases, each reported through the progress callback:
//
//	resolve  read the manifest and config (registry, OCI layout dir,
//	         docker-archive tar, OCI-archive tar); no layer yet
//	extract  stream every layer, verifying its digest, and flatten them
//	         (whiteouts applied) into a staging dir
//	inject   add /usr/local/bin/cube-agent and the files runtimes bind over
//	mkfs     mkfs.ext4 -d staging into a temp file, renamed onto Output
//	done
//
// Resolve and Build split Import in two so a caller can look at the
// image's digest before paying for its layers (cubelet reuses a template
// already built from the same digest).
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
	"runtime"
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

// ImportRequest describes one template import. Exactly one of Source and
// Registry names the image.
type ImportRequest struct {
	Source      string    // OCI image layout dir, or OCI-archive / docker-archive tar file
	Registry    *Registry // an image in a registry
	AgentBinary string    // static cube-agent, injected at AgentPath mode 0755
	HeadroomMiB int64     // free space left in the image; default 64
	Output      string    // ext4 raw image to write (replaced atomically)
	WorkDir     string    // scratch space; default the directory of Output
}

// Meta is what the runtime needs from the image config.
type Meta struct {
	Digest          string // manifest digest of the imported image
	Entrypoint, Cmd []string
	Env             []string
	WorkingDir      string
	User            string
	SizeBytes       int64 // apparent size of the written ext4 image
	// StartCmd and ReadyCmd come from the image labels LabelStartCmd and
	// LabelReadyCmd: a service the template runs in every sandbox it
	// starts, and the shell command that exits 0 once it serves.
	StartCmd, ReadyCmd string
	// DefaultWorkdir comes from the image label LabelWorkdir.
	DefaultWorkdir string
}

// Image labels a template's service is declared by (E2B's start and
// ready commands): cubelet starts the one and waits for the other before
// a sandbox from the template counts as created.
const (
	LabelStartCmd = "dev.cube.start-cmd"
	LabelReadyCmd = "dev.cube.ready-cmd"
	// LabelWorkdir is where commands start in a sandbox of the template
	// (E2B's template workdir: a template build's setWorkdir). Without it
	// they start in the user's home, whatever the image's WORKDIR.
	LabelWorkdir = "dev.cube.workdir"
)

// Progress reports where an import is. Phases are resolve, extract,
// inject, mkfs and done (cubelet adds reuse). During extract, Layer counts
// layers opened so far (the flattener walks from the top layer down) and
// Bytes counts layer blob bytes read, out of Total, the sum of the layer
// sizes the manifest declares (0 for docker archives, whose layers are
// checked uncompressed and have no declared size).
type Progress struct {
	Phase         string
	Layer, Layers int
	Bytes, Total  int64
}

// Import writes req.Output from the image req names. A source that cannot
// be read as an image, or a layer that does not match its digest, yields
// errdefs.ErrInvalidArgument; registry failures are classified as
// ErrUnauthenticated, ErrPermissionDenied, ErrNotFound or ErrUnavailable.
func Import(ctx context.Context, req ImportRequest, progress func(Progress)) (Meta, error) {
	if progress == nil {
		progress = func(Progress) {}
	}
	progress(Progress{Phase: "resolve"})
	r, err := Resolve(ctx, req)
	if err != nil {
		return Meta{}, err
	}
	meta, err := r.Build(ctx, progress)
	if cerr := r.Close(); cerr != nil && err == nil {
		return Meta{}, cerr
	}
	return meta, err
}

// Resolved is an image whose manifest and config have been read but none
// of its layers. Close it when done.
type Resolved struct {
	Meta   Meta  // all but SizeBytes
	Layers int   // number of layers
	Bytes  int64 // sum of declared layer sizes; 0 when unknown
	Source string

	req      ImportRequest
	img      v1.Image
	byDiffID bool
	scratch  string
	headroom int64
	log      *slog.Logger
}

// Resolve validates req and reads the image's manifest and config. For a
// registry image ctx also bounds the layer downloads Build does later.
func Resolve(ctx context.Context, req ImportRequest) (_ *Resolved, err error) {
	if (req.Source == "") == (req.Registry == nil) {
		return nil, invalid("exactly one of Source and Registry is required")
	}
	if req.Output == "" || req.AgentBinary == "" {
		return nil, invalid("Output and AgentBinary are required")
	}
	if st, err := os.Stat(req.AgentBinary); err != nil || !st.Mode().IsRegular() {
		return nil, invalid("agent binary %s is not a regular file", req.AgentBinary)
	}
	if req.Registry != nil {
		if _, err := req.Registry.validate(); err != nil {
			return nil, err
		}
	}
	r := &Resolved{req: req, headroom: req.HeadroomMiB}
	if r.headroom <= 0 {
		r.headroom = defaultHeadroomMiB
	}
	workDir := req.WorkDir
	if workDir == "" {
		workDir = filepath.Dir(req.Output)
	}
	if err := os.MkdirAll(workDir, 0o755); err != nil {
		return nil, fmt.Errorf("template: work dir: %w", err)
	}
	if r.scratch, err = os.MkdirTemp(workDir, ".import-*"); err != nil {
		return nil, fmt.Errorf("template: scratch dir: %w", err)
	}
	defer func() {
		if err != nil {
			_ = r.Close()
		}
	}()

	if req.Registry != nil {
		r.Source = req.Registry.Ref
		r.img, err = openRegistry(ctx, *req.Registry)
	} else {
		r.Source = req.Source
		r.img, r.byDiffID, err = openSource(req.Source, r.scratch)
	}
	if err != nil {
		return nil, err
	}
	r.log = slog.With("source", r.Source, "output", req.Output)
	digest, err := r.img.Digest()
	if err != nil {
		return nil, imageErr(r, "image digest", err)
	}
	cf, err := r.img.ConfigFile()
	if err != nil {
		return nil, imageErr(r, "image config", err)
	}
	if cf.OS != "" && cf.Architecture != "" && (cf.OS != "linux" || cf.Architecture != runtime.GOARCH) {
		return nil, invalid("image %s is for %s/%s; this node runs linux/%s", r.Source, cf.OS, cf.Architecture, runtime.GOARCH)
	}
	layers, err := r.img.Layers()
	if err != nil {
		return nil, imageErr(r, "image layers", err)
	}
	r.Layers = len(layers)
	if !r.byDiffID {
		for _, l := range layers {
			n, err := l.Size()
			if err != nil {
				return nil, imageErr(r, "layer size", err)
			}
			r.Bytes += n
		}
	}
	r.Meta = Meta{
		Digest:         digest.String(),
		Entrypoint:     cf.Config.Entrypoint,
		Cmd:            cf.Config.Cmd,
		Env:            cf.Config.Env,
		WorkingDir:     cf.Config.WorkingDir,
		User:           cf.Config.User,
		StartCmd:       cf.Config.Labels[LabelStartCmd],
		ReadyCmd:       cf.Config.Labels[LabelReadyCmd],
		DefaultWorkdir: cf.Config.Labels[LabelWorkdir],
	}
	return r, nil
}

// imageErr classifies a failure reading image metadata: registry errors
// keep their class, anything else means the image is unusable.
func imageErr(r *Resolved, what string, err error) error {
	if r.req.Registry != nil {
		return registryErr(r.Source, err)
	}
	return invalid("%s: %v", what, err)
}

// Close removes the scratch directory.
func (r *Resolved) Close() error {
	if r.scratch == "" {
		return nil
	}
	if err := os.RemoveAll(r.scratch); err != nil {
		return fmt.Errorf("template: remove scratch: %w", err)
	}
	r.scratch = ""
	return nil
}

// Build streams the layers, verifying each, and writes Output. It may run
// once per Resolved.
func (r *Resolved) Build(ctx context.Context, progress func(Progress)) (Meta, error) {
	if progress == nil {
		progress = func(Progress) {}
	}
	if r.scratch == "" {
		return Meta{}, fmt.Errorf("template: Build on a closed image: %w", errdefs.ErrFailedPrecondition)
	}
	staging := filepath.Join(r.scratch, "rootfs")
	if err := os.Mkdir(staging, 0o755); err != nil {
		return Meta{}, fmt.Errorf("template: staging: %w", err)
	}
	rep := &reporter{fn: progress, cur: Progress{Phase: "extract", Layers: r.Layers, Total: r.Bytes}}
	defer rep.stop()
	rep.phase("extract")
	v := &verifier{byDiffID: r.byDiffID, rep: rep}
	stream := mutate.Extract(v.wrap(r.img))
	err := extractTo(ctx, stream, staging)
	if err == nil {
		// The flattener stops at each tar's end marker; the digests
		// cover the whole blob.
		err = v.verifyAll()
	}
	// Closing the pipe stops the flattening goroutine if we bailed early.
	_ = stream.Close()
	v.closeAll()
	if err != nil {
		return Meta{}, err
	}

	rep.phase("inject")
	if err := prepareRootfs(staging, r.req.AgentBinary); err != nil {
		return Meta{}, err
	}

	rep.phase("mkfs")
	used, inodes, err := measure(staging)
	if err != nil {
		return Meta{}, err
	}
	size := imageSize(used, inodes, r.headroom)
	if size, err = writeExt4(ctx, staging, r.req.Output, size, inodes, r.log); err != nil {
		return Meta{}, err
	}
	meta := r.Meta
	meta.SizeBytes = size
	r.log.Info("template imported", "digest", meta.Digest, "size_bytes", size, "layers", r.Layers)
	rep.mu.Lock()
	rep.cur.Layer = r.Layers
	rep.mu.Unlock()
	rep.phase("done")
	return meta, nil
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
