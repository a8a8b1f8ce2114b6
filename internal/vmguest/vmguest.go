// Package vmguest builds and loads the VM runtime's guest artifacts: the
// Debian cloud kernel (version resolved from its metapackage through apt,
// never hard-coded), a small busybox initramfs that loads the virtio
// drivers QEMU's microvm needs and hands PID 1 to cube-agent on the root
// disk, and the kernel command line. docs/vm-guest.md explains the choices.
package vmguest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"golang.org/x/sys/unix"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// Defaults; cubelet reads the guest directory from [vm] guest_dir.
const (
	DefaultOutDir      = "/var/lib/cube/vm"
	DefaultCacheDir    = "/var/cache/cube/vm"
	DefaultMetapackage = "linux-image-cloud-amd64"
	DefaultBusybox     = "/bin/busybox"
)

// File names inside an artifacts directory.
const (
	KernelFile   = "vmlinuz"
	InitrdFile   = "initrd.img"
	ManifestFile = "guest.json"
)

// Artifacts is one built guest.
type Artifacts struct {
	Dir           string
	Kernel        string // path of the kernel image
	Initrd        string // path of the initramfs
	KernelVersion string // e.g. 6.1.0-57-cloud-amd64
	Modules       []string
}

// Manifest is guest.json.
type Manifest struct {
	KernelVersion string    `json:"kernel_version"`
	KernelPackage string    `json:"kernel_package"`
	Modules       []string  `json:"modules"`
	BuiltAt       time.Time `json:"built_at"`
	InitrdSHA256  string    `json:"initrd_sha256"`
}

// BuildConfig configures Build; zero fields take the defaults above.
type BuildConfig struct {
	OutDir      string
	CacheDir    string // downloaded .deb files are kept here
	Metapackage string
	Busybox     string
	Log         *slog.Logger // progress lines
}

// Load reads an artifacts directory and checks its files exist.
func Load(dir string) (*Artifacts, error) {
	if dir == "" {
		return nil, fmt.Errorf("vmguest: empty guest dir: %w", errdefs.ErrInvalidArgument)
	}
	data, err := os.ReadFile(filepath.Join(dir, ManifestFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("vmguest: %s has no %s (build it: go run ./hack/vm-guest --out %s): %w",
			dir, ManifestFile, dir, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("vmguest: %w", err)
	}
	var m Manifest
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, fmt.Errorf("vmguest: %s: %v: %w", ManifestFile, err, errdefs.ErrInvalidArgument)
	}
	a := &Artifacts{
		Dir: dir, Kernel: filepath.Join(dir, KernelFile), Initrd: filepath.Join(dir, InitrdFile),
		KernelVersion: m.KernelVersion, Modules: m.Modules,
	}
	for _, p := range []string{a.Kernel, a.Initrd} {
		if _, err := os.Stat(p); err != nil {
			return nil, fmt.Errorf("vmguest: %s: %w", p, errdefs.ErrNotFound)
		}
	}
	return a, nil
}

// Build makes sure dir holds the artifacts for the kernel the metapackage
// currently points at. It returns at once when guest.json already names
// that kernel and the files exist; otherwise it downloads the kernel
// package (kept in CacheDir), unpacks it and writes the three files, each
// through a rename, guest.json last.
func Build(ctx context.Context, cfg BuildConfig) (*Artifacts, error) {
	cfg = withDefaults(cfg)
	log := cfg.Log
	pkg, version, err := resolveKernel(ctx, cfg.Metapackage)
	if err != nil {
		return nil, err
	}
	if a, err := Load(cfg.OutDir); err == nil && a.KernelVersion == version {
		log.Info("vm guest up to date", "dir", cfg.OutDir, "kernel", version)
		return a, nil
	}
	log.Info("building vm guest", "dir", cfg.OutDir, "kernel_package", pkg)
	for _, d := range []string{cfg.OutDir, cfg.CacheDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, fmt.Errorf("vmguest: %w", err)
		}
	}
	deb, err := download(ctx, cfg.CacheDir, pkg, log)
	if err != nil {
		return nil, err
	}
	tmp, err := os.MkdirTemp(cfg.CacheDir, "unpack-")
	if err != nil {
		return nil, fmt.Errorf("vmguest: %w", err)
	}
	defer os.RemoveAll(tmp)
	log.Info("unpacking", "deb", deb)
	if out, err := exec.CommandContext(ctx, "dpkg-deb", "-x", deb, tmp).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("vmguest: dpkg-deb -x %s: %v: %s: %w", deb, err, bytes.TrimSpace(out), errdefs.ErrInternal)
	}
	ms, err := scanModules(filepath.Join(tmp, "lib/modules", version))
	if err != nil {
		return nil, err
	}
	mods, err := ms.resolve(RootModules)
	if err != nil {
		return nil, err
	}
	log.Info("modules resolved", "load_order", strings.Join(mods, ","))
	initrd, err := initramfs(cfg.Busybox, mods, ms.paths)
	if err != nil {
		return nil, err
	}
	kernel, err := os.ReadFile(filepath.Join(tmp, "boot", "vmlinuz-"+version))
	if err != nil {
		return nil, fmt.Errorf("vmguest: kernel image in %s: %w", pkg, err)
	}
	sum := sha256.Sum256(initrd)
	m := Manifest{KernelVersion: version, KernelPackage: pkg, Modules: mods,
		BuiltAt: time.Now().UTC(), InitrdSHA256: hex.EncodeToString(sum[:])}
	manifest, _ := json.MarshalIndent(m, "", "  ")
	// guest.json goes last: until it names the new kernel, Load and the
	// cache check see the old guest (or none).
	for _, f := range []struct {
		name string
		data []byte
	}{{KernelFile, kernel}, {InitrdFile, initrd}, {ManifestFile, append(manifest, '\n')}} {
		if err := writeFileAtomic(filepath.Join(cfg.OutDir, f.name), f.data, 0o644); err != nil {
			return nil, fmt.Errorf("vmguest: write %s: %w", f.name, err)
		}
	}
	log.Info("vm guest built", "dir", cfg.OutDir, "kernel", version, "initrd_bytes", len(initrd))
	return Load(cfg.OutDir)
}

func withDefaults(cfg BuildConfig) BuildConfig {
	if cfg.OutDir == "" {
		cfg.OutDir = DefaultOutDir
	}
	if cfg.CacheDir == "" {
		cfg.CacheDir = DefaultCacheDir
	}
	if cfg.Metapackage == "" {
		cfg.Metapackage = DefaultMetapackage
	}
	if cfg.Busybox == "" {
		cfg.Busybox = DefaultBusybox
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	return cfg
}

var kernelPkgRE = regexp.MustCompile(`^linux-image-([0-9][A-Za-z0-9.+~-]*)$`)

// resolveKernel asks apt which linux-image package the metapackage's
// candidate version depends on: the kernel version is that name's suffix.
func resolveKernel(ctx context.Context, meta string) (pkg, version string, err error) {
	out, err := exec.CommandContext(ctx, "apt-cache", "depends", "--important", meta).Output()
	if err != nil {
		return "", "", fmt.Errorf("vmguest: apt-cache depends %s: %v: %w", meta, err, errdefs.ErrNotFound)
	}
	for _, line := range strings.Split(string(out), "\n") {
		dep, ok := strings.CutPrefix(strings.TrimSpace(line), "Depends:")
		if !ok {
			continue
		}
		dep = strings.TrimSpace(dep)
		if m := kernelPkgRE.FindStringSubmatch(dep); m != nil {
			return dep, m[1], nil
		}
	}
	return "", "", fmt.Errorf("vmguest: %s depends on no linux-image package: %w", meta, errdefs.ErrNotFound)
}

// download fetches pkg into dir unless a .deb of it is there already.
// Builds in other processes (test packages run in parallel) share dir, so
// the check and the download run under an exclusive lock on it: none of
// them ever sees another's half-downloaded file.
func download(ctx context.Context, dir, pkg string, log *slog.Logger) (string, error) {
	lock, err := os.OpenFile(filepath.Join(dir, ".lock"), os.O_CREATE|os.O_RDWR|unix.O_CLOEXEC, 0o644)
	if err != nil {
		return "", fmt.Errorf("vmguest: %w", err)
	}
	defer lock.Close() // releases the lock
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return "", fmt.Errorf("vmguest: lock %s: %w", dir, err)
	}
	if debs, _ := filepath.Glob(filepath.Join(dir, pkg+"_*.deb")); len(debs) > 0 {
		return debs[len(debs)-1], nil
	}
	log.Info("downloading", "package", pkg, "dir", dir)
	cmd := exec.CommandContext(ctx, "apt-get", "download", pkg)
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("vmguest: apt-get download %s: %v: %s: %w", pkg, err, bytes.TrimSpace(out), errdefs.ErrUnavailable)
	}
	debs, _ := filepath.Glob(filepath.Join(dir, pkg+"_*.deb"))
	if len(debs) == 0 {
		return "", fmt.Errorf("vmguest: apt-get download %s left no .deb in %s: %w", pkg, dir, errdefs.ErrInternal)
	}
	return debs[len(debs)-1], nil
}
