package vm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/vmguest"
)

// QEMU's own memory on top of guest RAM, charged to the sandbox's cgroup
// with it: device emulation, I/O threads and (TCG) the translation cache
// bounded by tcgTBSizeMiB. Measured RSS minus guest RAM: see docs/vm.md.
const (
	overheadKVMMiB = 96
	overheadTCGMiB = 192
)

// maxSocketPath is sun_path's size minus the terminating NUL.
const maxSocketPath = 107

func lookPath(bin string) (string, error) { return exec.LookPath(bin) }

// Start implements runtime.Driver: it returns once QEMU runs the guest
// (QMP says "running"); waiting for the agent is the caller's job.
func (d *Driver) Start(ctx context.Context, s runtime.Spec) (runtime.State, error) {
	if err := ctx.Err(); err != nil {
		return runtime.State{}, fmt.Errorf("vm start %s: %w", s.ID, err)
	}
	g, err := vmguest.Load(d.guestDir)
	if err != nil {
		return runtime.State{}, fmt.Errorf("vm start %s: %w", s.ID, err)
	}
	sum, err := kernelSHA(g.Kernel)
	if err != nil {
		return runtime.State{}, fmt.Errorf("vm start %s: %w", s.ID, err)
	}
	mem := s.Limits.MemoryMiB
	if mem <= 0 {
		mem = d.defMem
	}
	hostname := s.Hostname
	if hostname == "" {
		hostname = s.ID
	}
	opts := vmguest.CmdlineOptions{TCG: d.accel == "tcg", Hostname: hostname, Extra: d.extra}
	shape := Shape{
		MemoryMiB: mem, VCPUs: vcpusFor(s.Limits.MilliCPU), Accel: d.accel, Machine: Machine,
		CPU: cpuModel(d.accel), Kernel: g.Kernel, Initrd: g.Initrd, KernelVersion: g.KernelVersion,
		KernelSHA256: sum, Devices: []string{"virtio-blk", "virtio-serial"},
	}
	if d.vsock {
		shape.Devices = append(shape.Devices, "vhost-vsock")
	}
	if s.NetNSPath != "" {
		opts.Net = &vmguest.NetConfig{Addr: guestPrefix(), Gateway: network.SandboxGateway}
		shape.Devices = append(shape.Devices, "virtio-net")
		if d.vhost {
			shape.Devices = append(shape.Devices, "vhost-net")
		}
		shape.MAC = macFor(s.ID)
	}
	shape.Cmdline = vmguest.Cmdline(opts)
	return d.launch(ctx, s, shape, "", "")
}

// launch starts QEMU for s with shape; with image set it restores the
// memory image at that path instead of booting. On failure nothing of
// s.ID is left, unless the failure is that s.ID exists already.
func (d *Driver) launch(ctx context.Context, s runtime.Spec, shape Shape, image, note string) (runtime.State, error) {
	begin := time.Now()
	verb := "start"
	if image != "" {
		verb = "restore"
	}
	fail := func(err error) (runtime.State, error) {
		return runtime.State{}, fmt.Errorf("vm %s %s: %w", verb, s.ID, err)
	}
	if err := validID(s.ID); err != nil {
		return fail(err)
	}
	if !filepath.IsAbs(s.BundleDir) {
		return fail(fmt.Errorf("BundleDir %q is not absolute: %w", s.BundleDir, errdefs.ErrInvalidArgument))
	}
	if s.Disk == "" {
		return fail(fmt.Errorf("no root disk (Spec.Disk): the vm runtime boots a disk image: %w", errdefs.ErrInvalidArgument))
	}
	if fi, err := os.Stat(s.Disk); err != nil || !fi.Mode().IsRegular() {
		return fail(fmt.Errorf("root disk %s is not a regular file: %w", s.Disk, errdefs.ErrInvalidArgument))
	}
	p := paths{
		Disk: s.Disk, QMP: filepath.Join(s.BundleDir, "qmp.sock"), Agent: filepath.Join(s.BundleDir, "agent.sock"),
		Console: filepath.Join(s.BundleDir, "console.log"), Log: filepath.Join(s.BundleDir, "qemu.log"),
		PIDFile: filepath.Join(s.BundleDir, "qemu.pid"),
	}
	if len(p.Agent) > maxSocketPath || len(p.QMP) > maxSocketPath {
		return fail(fmt.Errorf("bundle %s is too long for a unix socket path (%d bytes max): %w", s.BundleDir, maxSocketPath, errdefs.ErrInvalidArgument))
	}
	if shape.has("vhost-vsock") {
		p.VsockCID = cidFor(s.ID)
	}
	if err := os.MkdirAll(d.root, 0o700); err != nil {
		return fail(err)
	}
	// Mkdir is the lock: of two concurrent Starts of one ID only one
	// creates the state dir.
	if err := os.Mkdir(d.stateDir(s.ID), 0o700); errors.Is(err, fs.ErrExist) {
		return fail(errdefs.ErrAlreadyExists)
	} else if err != nil {
		return fail(err)
	}
	st := &vmState{
		ID: s.ID, Bundle: s.BundleDir, QMP: p.QMP, Agent: p.Agent, Console: p.Console, Cgroup: s.CgroupPath,
		Accel: shape.Accel, CID: p.VsockCID, Started: time.Now().UTC(), Shape: shape, ShapeNote: note,
	}
	st0, err := d.boot(ctx, s, st, p, image)
	if err != nil {
		if cerr := d.destroy(ctx, st); cerr != nil {
			d.log.WarnContext(ctx, "rollback of failed "+verb, "id", s.ID, "error", cerr)
			err = errors.Join(err, cerr)
		}
		return fail(err)
	}
	d.log.DebugContext(ctx, verb, "id", s.ID, "pid", st.PID, "accel", shape.Accel, "took", time.Since(begin))
	return st0, nil
}

func (d *Driver) boot(ctx context.Context, s runtime.Spec, st *vmState, p paths, image string) (runtime.State, error) {
	if err := d.save(st); err != nil {
		return runtime.State{}, err
	}
	if err := os.MkdirAll(s.BundleDir, 0o700); err != nil {
		return runtime.State{}, err
	}
	for _, f := range []string{p.QMP, p.Agent, p.PIDFile} {
		if err := os.Remove(f); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return runtime.State{}, err
		}
	}
	argv := append([]string{d.qemu}, qemuArgs(st.Shape, p, image != "")...)
	if s.NetNSPath != "" {
		// nsenter execs QEMU in the namespace: the TAP is only visible
		// there, and QEMU's daemonized child stays in it.
		argv = append([]string{"nsenter", "--net=" + s.NetNSPath, "--"}, argv...)
	}
	pid, err := d.spawn(ctx, argv, p)
	if pid > 0 {
		st.PID = pid
		if serr := d.save(st); serr != nil {
			err = errors.Join(err, serr)
		}
	}
	if err != nil {
		return runtime.State{}, err
	}
	if s.CgroupPath != "" {
		if err := joinCgroup(s.CgroupPath, pid, d.limits(st.Shape, s.Limits)); err != nil {
			return runtime.State{}, err
		}
	}
	if err := ctx.Err(); err != nil {
		return runtime.State{}, err
	}
	if image != "" {
		if err := d.incoming(ctx, st, image, p.Log); err != nil {
			return runtime.State{}, err
		}
	}
	if err := d.execute(ctx, st, "cont", nil, nil); err != nil {
		return runtime.State{}, fmt.Errorf("cont: %w%s", err, logTail(p.Log))
	}
	out, err := d.status(ctx, st)
	if err == nil && out.Status != runtime.StatusRunning {
		err = fmt.Errorf("QEMU is %s right after cont: %w%s", out.Status, errdefs.ErrUnavailable, logTail(p.Log))
	}
	return out, err
}

// spawn runs QEMU with -daemonize: the command returns once QEMU is
// initialised (devices, sockets) and its daemon child, in its own session
// and holding no pipe of ours, carries on. It returns the daemon's pid.
func (d *Driver) spawn(ctx context.Context, argv []string, p paths) (int, error) {
	_ = os.Remove(p.Log)
	logf, err := os.OpenFile(p.Log, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return 0, err
	}
	defer logf.Close()
	cmd := exec.Command(argv[0], argv[1:]...)
	// A file, never a pipe: QEMU keeps stderr until it daemonizes, and
	// the daemon must not hold anything of cubelet's.
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	err = cmd.Run()
	b, rerr := os.ReadFile(p.PIDFile)
	pid, perr := strconv.Atoi(strings.TrimSpace(string(b)))
	if rerr != nil || perr != nil || pid <= 0 {
		pid = 0
	}
	if err != nil {
		return pid, fmt.Errorf("qemu: %w%s", err, logTail(p.Log))
	}
	if pid == 0 {
		return 0, fmt.Errorf("qemu wrote no pid file %s: %w%s", p.PIDFile, errdefs.ErrInternal, logTail(p.Log))
	}
	return pid, ctx.Err()
}

// limits: the cgroup holds QEMU, so memory is guest RAM plus QEMU's own;
// CPU is the requested share. Limits.Pids is not applied: it is meant for
// the guest's processes, which the guest kernel runs, while QEMU's threads
// (vCPUs, the I/O pool) must not be capped by it.
func (d *Driver) limits(s Shape, l runtime.Limits) cgroupLimits {
	over := int64(overheadKVMMiB)
	if s.Accel == "tcg" {
		over = overheadTCGMiB
	}
	out := cgroupLimits{MemoryBytes: (s.MemoryMiB + over) << 20}
	if l.MilliCPU > 0 {
		out.CPUQuotaUS = l.MilliCPU * cpuPeriodUS / 1000
	}
	return out
}

// guestPrefix is the guest's eth0 address in every slot.
func guestPrefix() netip.Prefix {
	return netip.PrefixFrom(network.SandboxIP, network.SandboxPrefixBits)
}

// logTail quotes the end of QEMU's log for an error message.
func logTail(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	const n = 1024
	if fi, err := f.Stat(); err == nil && fi.Size() > n {
		_, _ = f.Seek(-n, io.SeekEnd)
	}
	b, _ := io.ReadAll(f)
	s := strings.TrimSpace(string(b))
	if s == "" {
		return ""
	}
	return ": qemu log: " + s
}

var (
	shaMu    sync.Mutex
	shaCache = map[string]string{} // path|size|mtime -> sha256
)

// kernelSHA identifies the kernel a snapshot's memory was booted from:
// a restore under another kernel file would run the old kernel's memory
// with the new one's firmware tables.
func kernelSHA(path string) (string, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return "", err
	}
	key := fmt.Sprintf("%s|%d|%d", path, fi.Size(), fi.ModTime().UnixNano())
	shaMu.Lock()
	defer shaMu.Unlock()
	if s, ok := shaCache[key]; ok {
		return s, nil
	}
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	s := hex.EncodeToString(h.Sum(nil))
	shaCache[key] = s
	return s, nil
}
