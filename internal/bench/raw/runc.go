// Package raw runs the building blocks cubelet stands on bare, without
// cubelet, so that cube-bench can time them next to cubelet's own
// operations: `runc run -d` of the agent on a rootfs prepared the way
// cubelet prepares one, `runc pause|resume|delete`, the cgroup freezer,
// `podman run`, `runsc restore` of a checkpoint and QEMU `-incoming` of a
// memory snapshot, each until the agent answers /health the way cubelet
// waits for it. It also holds the host-level helpers (cgroup hierarchies,
// loop devices) the bench uses to measure and to clean up. It knows
// nothing of scenarios or reports: package bench times what it runs.
package raw

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/agentclient"
	"github.com/cubesandbox/cube/internal/cubelet/config"
	"github.com/cubesandbox/cube/internal/leakcheck"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/cgroups"
	"github.com/cubesandbox/cube/internal/runtime/ocispec"
	"github.com/cubesandbox/cube/internal/storage"
	"github.com/cubesandbox/cube/internal/template"
)

// Runc is the bench's own minimal node for the raw runc baselines: a
// reflink pool of its own (a loop-mounted XFS image, like cubelet's), a
// template image built from the same OCI image and agent binary as
// cubelet's template, a runc root and a cgroup parent. Each baseline
// container gets a fresh FICLONE of that image loop-mounted as its rootfs,
// prepared before the clock starts: the baseline times runc and the agent,
// on a rootfs in exactly the state cubelet gives its sandboxes.
type Runc struct {
	dir          string
	runc         string
	runcRoot     string
	cgroupParent string
	image        string
	pool         *storage.Pool
	defaults     runtime.Limits
	seq          atomic.Int64
}

// Box is one bare runc container of the agent.
type Box struct {
	n      *Runc
	ID     string
	disk   string
	rootfs string
	bundle string
	cgroup string
	// PID is the host PID of the container's PID 1, once started.
	PID int
}

// NewRunc sets up a raw runc node in dir (which it removes on Close),
// with its containers under cgroupParent and its template image imported
// from imageLayout with agentBinary.
func NewRunc(ctx context.Context, dir, cgroupParent, imageLayout, agentBinary string) (*Runc, error) {
	bin, err := exec.LookPath("runc")
	if err != nil {
		return nil, errors.New("runc is not installed")
	}
	defCfg, err := config.Parse(nil)
	if err != nil {
		return nil, err
	}
	d := defCfg.Sandbox
	n := &Runc{
		dir:          dir,
		runc:         bin,
		runcRoot:     filepath.Join(dir, "runc"),
		cgroupParent: cgroupParent,
		defaults:     runtime.Limits{MilliCPU: d.DefaultMilliCPU, MemoryMiB: d.DefaultMemoryMiB, Pids: d.DefaultPids},
	}
	n.pool, err = storage.OpenPool(ctx, storage.PoolConfig{Dir: filepath.Join(dir, "pool"), ImageSizeBytes: 8 << 30})
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("raw baseline pool: %w", err)
	}
	n.image = filepath.Join(n.pool.Dir(), "templates", "raw", "rootfs.img")
	if err := os.MkdirAll(filepath.Dir(n.image), 0o755); err != nil {
		return nil, errors.Join(err, n.Close(ctx))
	}
	// The same importer, image and agent as cubelet's template, with
	// cubelet's default headroom, so both rootfs images are alike.
	if _, err := template.Import(ctx, template.ImportRequest{
		Source: imageLayout, AgentBinary: agentBinary,
		HeadroomMiB: defCfg.Storage.TemplateHeadroomMiB, Output: n.image,
	}, nil); err != nil {
		return nil, errors.Join(fmt.Errorf("raw baseline template: %w", err), n.Close(ctx))
	}
	return n, nil
}

// PoolDir is the node's reflink pool (FICLONE works within it).
func (n *Runc) PoolDir() string { return n.pool.Dir() }

// Image is the node's template rootfs image, in the pool.
func (n *Runc) Image() string { return n.image }

// Prepare clones and mounts a rootfs and writes the bundle: everything
// before `runc run`, untimed.
func (n *Runc) Prepare(ctx context.Context) (b *Box, err error) {
	id := fmt.Sprintf("raw-%d", n.seq.Add(1))
	b = &Box{
		n:      n,
		ID:     id,
		disk:   filepath.Join(n.pool.Dir(), "sandboxes", id, "disk.img"),
		rootfs: filepath.Join(n.dir, "run", "sandboxes", id, "rootfs"),
		bundle: filepath.Join(n.dir, "run", "sandboxes", id, "bundle"),
		cgroup: "/" + n.cgroupParent + "/" + id,
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, b.Destroy(context.WithoutCancel(ctx)))
		}
	}()
	if err := n.pool.Clone(ctx, n.image, b.disk); err != nil {
		return b, err
	}
	if _, err := storage.MountDisk(ctx, b.disk, b.rootfs, false); err != nil {
		return b, err
	}
	// The spec cubelet's runc driver would write for a sandbox with the
	// node's default limits: same namespaces, mounts, devices, limits.
	sp, err := ocispec.For(runtime.Spec{
		ID:         id,
		BundleDir:  b.bundle,
		RootFS:     b.rootfs,
		Args:       []string{cubelet.AgentPath, "--addr", ":" + strconv.Itoa(agentproto.Port)},
		Env:        []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "CUBE_SANDBOX_ID=" + id},
		Cwd:        "/",
		Hostname:   id,
		CgroupPath: b.cgroup,
		Limits:     n.defaults,
	})
	if err != nil {
		return b, err
	}
	fitRlimits(sp)
	if err := os.MkdirAll(b.bundle, 0o700); err != nil {
		return b, err
	}
	data, err := json.Marshal(sp)
	if err != nil {
		return b, err
	}
	return b, os.WriteFile(filepath.Join(b.bundle, "config.json"), data, 0o600)
}

// Start is the bare `runc run -d`; it returns PID 1's host PID.
func (b *Box) Start(ctx context.Context) (int, error) {
	console, err := os.OpenFile(filepath.Join(b.bundle, "console.log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return 0, err
	}
	defer console.Close()
	pidFile := filepath.Join(b.bundle, "init.pid")
	cmd := exec.CommandContext(ctx, b.n.runc, "--root", b.n.runcRoot, "run", "-d", "--pid-file", pidFile, "--bundle", b.bundle, b.ID)
	cmd.Stdout, cmd.Stderr = console, console
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Run(); err != nil {
		log, _ := os.ReadFile(console.Name())
		return 0, fmt.Errorf("runc run %s: %w: %s", b.ID, err, lastLine(log))
	}
	pid, err := readPidFile(pidFile)
	if err != nil {
		return 0, err
	}
	b.PID = pid
	return pid, nil
}

// Runc runs one runc verb on the box.
func (b *Box) Runc(ctx context.Context, args ...string) error {
	full := append([]string{"--root", b.n.runcRoot}, args...)
	out, err := exec.CommandContext(ctx, b.n.runc, full...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("runc %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// Destroy removes everything Prepare and Start made; safe to call on a
// half-prepared box and twice.
func (b *Box) Destroy(ctx context.Context) error {
	var errs []error
	if _, err := os.Stat(filepath.Join(b.n.runcRoot, b.ID)); err == nil {
		errs = append(errs, b.Runc(ctx, "delete", "--force", b.ID))
	}
	_, err := cgroups.Remove(b.cgroup, 2*time.Second)
	errs = append(errs, err)
	errs = append(errs, storage.UnmountDisk(ctx, b.rootfs, b.disk))
	if err := os.RemoveAll(filepath.Dir(b.bundle)); err != nil {
		errs = append(errs, err)
	}
	if err := os.RemoveAll(filepath.Dir(b.disk)); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// Close removes whatever containers are left, the pool and the directory.
func (n *Runc) Close(ctx context.Context) error {
	ctx = context.WithoutCancel(ctx)
	var errs []error
	if ents, err := os.ReadDir(n.runcRoot); err == nil {
		for _, ent := range ents {
			b := &Box{n: n, ID: ent.Name()}
			errs = append(errs, b.Runc(ctx, "delete", "--force", ent.Name()))
		}
	}
	if ents, err := os.ReadDir(filepath.Join(n.dir, "run", "sandboxes")); err == nil {
		for _, ent := range ents {
			rootfs := filepath.Join(n.dir, "run", "sandboxes", ent.Name(), "rootfs")
			errs = append(errs, storage.UnmountDisk(ctx, rootfs, filepath.Join(n.pool.Dir(), "sandboxes", ent.Name(), "disk.img")))
		}
	}
	errs = append(errs, RemoveCgroupTree("/"+n.cgroupParent))
	if n.pool != nil {
		errs = append(errs, n.pool.Teardown(ctx), WaitLoopGone(n.pool.Dir()+".img", LoopGoneWait))
	}
	if err := os.RemoveAll(n.dir); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// Scope is what the leak checker inspects for the raw node: the same
// layout as a cubelet's (pool/sandboxes, run/sandboxes, runc root).
func (n *Runc) Scope() leakcheck.Scope {
	pool := n.pool.Dir()
	return leakcheck.Scope{
		DataDir: n.dir, RunDir: filepath.Join(n.dir, "run"), RuncRoot: n.runcRoot, CgroupName: n.cgroupParent,
		AllowMounts: []string{pool}, AllowLoopBacking: []string{pool + ".img"},
	}
}

// fitRlimits lowers rlimits above this process's hard limits, as
// cubelet's runc driver does: without CAP_SYS_RESOURCE runc cannot raise
// them and the start would fail.
func fitRlimits(sp *specs.Spec) {
	res := map[string]int{"RLIMIT_NOFILE": unix.RLIMIT_NOFILE, "RLIMIT_NPROC": unix.RLIMIT_NPROC}
	for i, rl := range sp.Process.Rlimits {
		r, ok := res[rl.Type]
		if !ok {
			continue
		}
		var cur unix.Rlimit
		if unix.Getrlimit(r, &cur) != nil || cur.Max == unix.RLIM_INFINITY {
			continue
		}
		if rl.Hard > cur.Max {
			sp.Process.Rlimits[i].Hard = cur.Max
			sp.Process.Rlimits[i].Soft = min(rl.Soft, cur.Max)
		}
	}
}

// WaitAgent is cubelet's own readiness check (the same /health poll, the
// same back-off), so baselines and cube scenarios stop the clock alike.
func WaitAgent(ctx context.Context, pid int) error {
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	return agentclient.WaitAgent(ctx, pid)
}
