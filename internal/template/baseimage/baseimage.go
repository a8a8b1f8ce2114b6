// Package baseimage builds `base`, the default sandbox template image (the
// one the E2B SDK's Sandbox.create() asks for): Debian (bookworm by
// default) bootstrapped locally with debootstrap --variant=minbase plus
// python3, bash, coreutils, curl, ca-certificates and procps, with the
// users root and user (uid 1000, home /home/user). It comes from the
// Debian mirror apt on this machine already uses, never another host, and
// is written as an OCI image layout with one uncompressed layer.
//
// Builds are cached: the layout is rebuilt only when an input changes —
// suite, mirror, package list, this builder's recipe version, the
// debootstrap version, or the mirror's Release file (a new point release
// or snapshot). If the mirror cannot be reached and a layout exists, the
// layout is used as is.
//
// Needs root (debootstrap, chroot). debootstrap runs in a private mount
// namespace, so the /proc, /sys and /dev mounts it makes inside the target
// cannot outlive it, whatever happens to the build.
package baseimage

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strings"
	"syscall"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// recipe versions what Build does to the bootstrapped tree; bump it when
// the steps below change so cached layouts are rebuilt.
const recipe = "1"

// Defaults.
const (
	DefaultSuite = "bookworm"
	LayoutName   = "base-oci"
	RefName      = "cube.local/base:latest"
)

// DefaultPackages are added to minbase (which already has bash and
// coreutils; they are listed because the template promises them).
var DefaultPackages = []string{"python3", "bash", "coreutils", "curl", "ca-certificates", "procps"}

// Options configure Build. Zero values take the defaults.
type Options struct {
	Dir      string   // cache directory; the layout is Dir/base-oci
	Suite    string   // Debian suite
	Mirror   *Mirror  // nil = FindMirror(AptDir, Suite)
	AptDir   string   // default /etc/apt
	Packages []string // default DefaultPackages
	Rebuild  bool     // ignore the cache
	Log      *slog.Logger
	// Name is the layout's directory name in Dir and its ref; default
	// LayoutName and RefName. Files are written into the tree after the
	// recipe (path relative to /), Labels added to the image config's.
	// Both are inputs of the cache.
	Name   string
	Files  map[string]File
	Labels map[string]string
	// Install are packages apt-get installs (no recommends) in the
	// bootstrapped tree, after debootstrap: apt orders the configuration
	// of large dependency trees, which debootstrap's --include does not.
	Install []string
	// Run are shell commands (sh -c) run in the finished tree, as root,
	// after Files (to prepare caches the image's programs would
	// otherwise build at their first start).
	Run []string
}

// File is a file an image adds to the bootstrapped tree.
type File struct {
	Mode os.FileMode
	Data []byte
}

// Inputs is everything a build depends on; it is stored next to the
// layout (Dir/base-oci.inputs.json) and compared on the next Build.
type Inputs struct {
	Recipe      string   `json:"recipe"`
	Suite       string   `json:"suite"`
	Mirror      string   `json:"mirror"`
	Packages    []string `json:"packages"`
	Debootstrap string   `json:"debootstrap"`
	Release     string   `json:"release_sha256"` // "" when the mirror was unreachable
	Arch        string   `json:"arch"`
	// Of images other than base only (omitted when empty, so that base's
	// cached inputs stay as they were).
	Name    string            `json:"name,omitempty"`
	Install []string          `json:"install,omitempty"`
	Run     []string          `json:"run,omitempty"`
	Files   string            `json:"files_sha256,omitempty"`
	Labels  map[string]string `json:"labels,omitempty"`
}

// Result says where the layout is and whether this call built it.
type Result struct {
	Layout string
	Built  bool
	Inputs Inputs
}

// Build returns the base image layout, building it when the cache is
// missing or stale.
func Build(ctx context.Context, o Options) (Result, error) {
	if o.Dir == "" {
		return Result{}, fmt.Errorf("baseimage: Dir is required: %w", errdefs.ErrInvalidArgument)
	}
	if o.Suite == "" {
		o.Suite = DefaultSuite
	}
	if o.AptDir == "" {
		o.AptDir = "/etc/apt"
	}
	if len(o.Packages) == 0 {
		o.Packages = DefaultPackages
	}
	if o.Log == nil {
		o.Log = slog.Default()
	}
	name := o.Name
	if name == "" {
		name = LayoutName
	}
	if o.Mirror == nil {
		m, err := FindMirror(o.AptDir, o.Suite)
		if err != nil {
			return Result{}, err
		}
		o.Mirror = &m
	}
	if err := os.MkdirAll(o.Dir, 0o755); err != nil {
		return Result{}, fmt.Errorf("baseimage: %w", err)
	}
	// One build per cache directory at a time (hack/up.sh and the tests
	// share /var/cache/cube/base); the lock dies with the process.
	lock, err := os.OpenFile(filepath.Join(o.Dir, ".lock"), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return Result{}, fmt.Errorf("baseimage: %w", err)
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return Result{}, fmt.Errorf("baseimage: lock %s: %w", o.Dir, err)
	}
	in, err := inputs(ctx, o)
	if err != nil {
		return Result{}, err
	}
	res := Result{Layout: filepath.Join(o.Dir, name), Inputs: in}
	inputsFile := res.Layout + ".inputs.json"
	if !o.Rebuild {
		if cached, ok := readInputs(inputsFile, res.Layout); ok {
			switch {
			case cached.equal(in):
				o.Log.Info("base image up to date", "layout", res.Layout)
				return res, nil
			case in.Release == "" && cached.sameExceptRelease(in):
				o.Log.Warn("base image: mirror unreachable; using the cached layout", "mirror", in.Mirror, "layout", res.Layout)
				res.Inputs = cached
				return res, nil
			}
		}
	}
	if in.Release == "" {
		return Result{}, fmt.Errorf("baseimage: mirror %s unreachable and no cached layout: %w", in.Mirror, errdefs.ErrUnavailable)
	}
	start := time.Now()
	if err := build(ctx, o, in, res.Layout); err != nil {
		return Result{}, err
	}
	data, _ := json.MarshalIndent(in, "", "  ")
	if err := os.WriteFile(inputsFile, append(data, '\n'), 0o644); err != nil {
		return Result{}, fmt.Errorf("baseimage: %w", err)
	}
	o.Log.Info("base image built", "layout", res.Layout, "took", time.Since(start).Round(time.Second))
	res.Built = true
	return res, nil
}

func inputs(ctx context.Context, o Options) (Inputs, error) {
	in := Inputs{Recipe: recipe, Suite: o.Suite, Mirror: o.Mirror.URI, Packages: o.Packages, Arch: runtime.GOARCH, Labels: o.Labels}
	if o.Name != LayoutName {
		in.Name = o.Name
	}
	if len(o.Files) > 0 {
		in.Files = filesDigest(o.Files)
	}
	in.Install, in.Run = o.Install, o.Run
	out, err := exec.CommandContext(ctx, "dpkg-query", "-W", "-f=${Version}", "debootstrap").Output()
	if err != nil || len(out) == 0 {
		return in, fmt.Errorf("baseimage: debootstrap is not installed (apt-get install debootstrap, or bash hack/deps.sh): %w", errdefs.ErrFailedPrecondition)
	}
	in.Debootstrap = string(out)
	in.Release = releaseDigest(ctx, o.Mirror.URI, o.Suite)
	return in, nil
}

// releaseDigest hashes the suite's Release file: it lists the digest of
// every package index, so any change in the archive changes it.
func releaseDigest(ctx context.Context, mirror, suite string) string {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, mirror+"/dists/"+suite+"/Release", nil)
	if err != nil {
		return ""
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return ""
	}
	h := sha256.New()
	if _, err := io.Copy(h, resp.Body); err != nil {
		return ""
	}
	return hex.EncodeToString(h.Sum(nil))
}

func readInputs(file, layoutDir string) (Inputs, bool) {
	var in Inputs
	if _, err := os.Stat(filepath.Join(layoutDir, "index.json")); err != nil {
		return in, false
	}
	data, err := os.ReadFile(file)
	if err != nil || json.Unmarshal(data, &in) != nil {
		return in, false
	}
	return in, true
}

func (a Inputs) equal(b Inputs) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return bytes.Equal(x, y)
}

func (a Inputs) sameExceptRelease(b Inputs) bool {
	x, y := a, b
	x.Release, y.Release = "", ""
	return x.equal(y)
}

// build bootstraps, configures and packs in a private directory under
// o.Dir, then renames the layout onto dst (same filesystem).
func build(ctx context.Context, o Options, in Inputs, dst string) (err error) {
	work, err := os.MkdirTemp(o.Dir, ".base-build-")
	if err != nil {
		return fmt.Errorf("baseimage: %w", err)
	}
	defer func() {
		if rerr := os.RemoveAll(work); rerr != nil && err == nil {
			err = fmt.Errorf("baseimage: remove %s: %w", work, rerr)
		}
	}()
	rootfs := filepath.Join(work, "rootfs")
	o.Log.Info("base image: debootstrap", "suite", o.Suite, "mirror", o.Mirror.URI, "packages", strings.Join(o.Packages, ","))
	args := []string{"--variant=minbase", "--include=" + strings.Join(o.Packages, ",")}
	if o.Mirror.Keyring != "" {
		args = append(args, "--keyring="+o.Mirror.Keyring)
	}
	args = append(args, o.Suite, rootfs, o.Mirror.URI)
	if err := run(ctx, filepath.Join(work, "debootstrap.log"), "debootstrap", args...); err != nil {
		return err
	}
	if len(o.Install) > 0 {
		o.Log.Info("base image: apt-get install", "packages", strings.Join(o.Install, ","))
		// debootstrap left the mirror in sources.list and the host's
		// resolv.conf in the tree; configure empties the latter after.
		script := "mount -t proc proc /proc && apt-get update -q && apt-get install -y -q --no-install-recommends " + strings.Join(o.Install, " ")
		if err := run(ctx, filepath.Join(work, "install.log"), "chroot", rootfs, "/bin/sh", "-c", script); err != nil {
			return err
		}
	}
	if err := configure(ctx, rootfs, filepath.Join(work, "configure.log")); err != nil {
		return err
	}
	if err := writeFiles(rootfs, o.Files); err != nil {
		return err
	}
	for _, c := range o.Run {
		o.Log.Info("base image: run", "command", c)
		if err := run(ctx, filepath.Join(work, "run.log"), "chroot", rootfs, "/bin/sh", "-c", "mountpoint -q /proc || mount -t proc proc /proc; "+c); err != nil {
			return err
		}
	}
	tarPath := filepath.Join(work, "layer.tar")
	digest, size, err := packDir(rootfs, tarPath, []string{"dev", "proc", "sys"})
	if err != nil {
		return err
	}
	img, err := image(&fileLayer{path: tarPath, digest: digest, size: size}, in)
	if err != nil {
		return err
	}
	lay := filepath.Join(work, LayoutName)
	p, err := layout.Write(lay, empty.Index)
	if err != nil {
		return fmt.Errorf("baseimage: layout: %w", err)
	}
	ref := RefName
	if in.Name != "" {
		ref = "cube.local/" + in.Name + ":latest"
	}
	if err := p.AppendImage(img, layout.WithAnnotations(map[string]string{"org.opencontainers.image.ref.name": ref})); err != nil {
		return fmt.Errorf("baseimage: layout: %w", err)
	}
	if err := os.RemoveAll(dst); err != nil {
		return fmt.Errorf("baseimage: replace %s: %w", dst, err)
	}
	_ = os.Remove(dst + ".inputs.json")
	if err := os.Rename(lay, dst); err != nil {
		return fmt.Errorf("baseimage: %w", err)
	}
	return nil
}

// configure runs the recipe's steps inside the new tree.
func configure(ctx context.Context, rootfs, logFile string) error {
	steps := [][]string{
		{"chroot", rootfs, "useradd", "--create-home", "--uid", "1000", "--user-group", "--shell", "/bin/bash", "user"},
		{"chroot", rootfs, "apt-get", "clean"},
	}
	for _, s := range steps {
		if err := run(ctx, logFile, s[0], s[1:]...); err != nil {
			return err
		}
	}
	// The build host's identity and caches do not belong in the image:
	// cubelet binds hostname, hosts and resolv.conf per sandbox.
	for _, p := range []string{"etc/hostname", "etc/resolv.conf", "etc/machine-id"} {
		if err := os.WriteFile(filepath.Join(rootfs, p), nil, 0o644); err != nil {
			return fmt.Errorf("baseimage: %s: %w", p, err)
		}
	}
	lists, _ := filepath.Glob(filepath.Join(rootfs, "var/lib/apt/lists/*_*"))
	logs, _ := filepath.Glob(filepath.Join(rootfs, "var/log/*.log"))
	for _, p := range append(append(lists, logs...), filepath.Join(rootfs, "var/cache/debconf/templates.dat-old"), filepath.Join(rootfs, "var/cache/debconf/config.dat-old")) {
		if err := os.RemoveAll(p); err != nil {
			return fmt.Errorf("baseimage: clean %s: %w", p, err)
		}
	}
	return nil
}

func image(layer v1.Layer, in Inputs) (v1.Image, error) {
	base := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	base = mutate.ConfigMediaType(base, types.OCIConfigJSON)
	img, err := mutate.AppendLayers(base, layer)
	if err != nil {
		return nil, fmt.Errorf("baseimage: %w", err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, fmt.Errorf("baseimage: %w", err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", runtime.GOARCH
	cf.Created = v1.Time{Time: time.Now().UTC().Truncate(time.Second)}
	cf.Config.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"}
	cf.Config.Cmd = []string{"/bin/bash"}
	cf.Config.WorkingDir = "/home/user"
	cf.Config.Labels = map[string]string{
		"org.opencontainers.image.title":       "cube base",
		"org.opencontainers.image.description": "Debian " + in.Suite + " minbase + " + strings.Join(append(slices.Clone(in.Packages), in.Install...), ", "),
		"dev.cube.base.mirror":                 in.Mirror,
		"dev.cube.base.recipe":                 in.Recipe,
	}
	for k, v := range in.Labels {
		cf.Config.Labels[k] = v
	}
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		return nil, fmt.Errorf("baseimage: %w", err)
	}
	return img, nil
}

// filesDigest hashes files (names, modes, contents) in name order.
func filesDigest(files map[string]File) string {
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	sort.Strings(names)
	h := sha256.New()
	for _, n := range names {
		fmt.Fprintf(h, "%s\x00%o\x00%d\x00", n, files[n].Mode, len(files[n].Data))
		h.Write(files[n].Data)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// writeFiles adds files to the tree, owned by root, with their parents.
func writeFiles(rootfs string, files map[string]File) error {
	for n, f := range files {
		p := filepath.Join(rootfs, filepath.Clean("/"+n))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return fmt.Errorf("baseimage: %w", err)
		}
		if err := os.WriteFile(p, f.Data, f.Mode); err != nil {
			return fmt.Errorf("baseimage: %w", err)
		}
		if err := os.Chmod(p, f.Mode); err != nil { // not umask's
			return fmt.Errorf("baseimage: %w", err)
		}
	}
	return nil
}

// run runs a build command in a private mount namespace, appending its
// output to logFile; a failure carries the output's tail.
func run(ctx context.Context, logFile, name string, args ...string) error {
	lf, err := os.OpenFile(logFile, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("baseimage: %w", err)
	}
	defer lf.Close()
	var tail tailBuffer
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Stdout = io.MultiWriter(lf, &tail)
	cmd.Stderr = cmd.Stdout
	cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive", "LC_ALL=C.UTF-8")
	// Go makes / recursively private in the child when it unshares the
	// mount namespace, so nothing mounted in there reaches the host.
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
	if err := cmd.Run(); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		kind := errdefs.ErrInternal
		var ee *exec.ExitError
		if !errors.As(err, &ee) {
			kind = errdefs.ErrFailedPrecondition // not installed, not root
		}
		return fmt.Errorf("baseimage: %s: %v: %s: %w", name, err, tail.String(), kind)
	}
	return nil
}

// tailBuffer keeps the last 2 KiB written to it.
type tailBuffer struct{ b []byte }

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.b = append(t.b, p...)
	if len(t.b) > 2048 {
		t.b = t.b[len(t.b)-2048:]
	}
	return len(p), nil
}

func (t *tailBuffer) String() string { return strings.TrimSpace(string(t.b)) }
