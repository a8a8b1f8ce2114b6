package vm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/hostload"
	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/qmp"
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
	opts := vmguest.CmdlineOptions{TCG: d.accel == "tcg", Hostname: hostname, TokenHash: s.AgentTokenHash, Extra: d.extra}
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
	if s.Resolver != "" {
		r, err := netip.ParseAddr(s.Resolver)
		if err != nil {
			return runtime.State{}, fmt.Errorf("vm start %s: resolver %q: %v: %w", s.ID, s.Resolver, err, errdefs.ErrInvalidArgument)
		}
		opts.Resolver = r
	}
	opts.EgressCA = s.EgressCA
	shape.Cmdline = vmguest.Cmdline(opts)
	if s.Labels[TemplateLabel] != "" {
		// Booted to become a warm template: RAM in a shared file, so
		// its snapshot is that file plus the device state (template.go).
		shape.RAMObject, shape.SharedRAM = true, true
	}
	return d.launch(ctx, s, shape, "", "", nil)
}

// launch starts QEMU for s with shape; with image set it restores the
// memory image at that path instead of booting. ram, when set, is a
// template's sealed RAM (template.go) the restore maps privately, the
// image then holding device state only; launch closes it. On failure
// nothing of s.ID is left, unless the failure is that s.ID exists already.
func (d *Driver) launch(ctx context.Context, s runtime.Spec, shape Shape, image, note string, ram *os.File) (runtime.State, error) {
	if ram != nil {
		defer ram.Close()
	}
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
	st0, err := d.boot(ctx, s, st, p, image, ram)
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

func (d *Driver) boot(ctx context.Context, s runtime.Spec, st *vmState, p paths, image string, ram *os.File) (_ runtime.State, bootErr error) {
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
	uid, err := d.uids.take(d.stateDir(st.ID))
	if err != nil {
		return runtime.State{}, err
	}
	st.UID = uid
	if err := d.save(st); err != nil {
		return runtime.State{}, err
	}
	t0 := time.Now()
	q, err := d.spawn(ctx, st, s, p, image, ram)
	tSpawn := time.Since(t0)
	if q != nil {
		defer q.release()
		defer func() {
			if bootErr != nil {
				q.kill(killTimeout)
			}
		}()
	}
	if err != nil {
		return runtime.State{}, err
	}
	if s.CgroupPath != "" {
		if err := joinCgroup(s.CgroupPath, st.PID, d.limits(st.Shape, s.Limits)); err != nil {
			return runtime.State{}, err
		}
		if q.unzstd != nil {
			if err := addToCgroup(s.CgroupPath, q.unzstd.Process.Pid); err != nil {
				d.log.DebugContext(ctx, "zstd stays in the driver's cgroup", "id", st.ID, "error", err)
			}
		}
	}
	if err := ctx.Err(); err != nil {
		return runtime.State{}, err
	}
	t1 := time.Now()
	if image != "" {
		if err := d.incoming(ctx, st, q, p.Log, ram != nil); err != nil {
			return runtime.State{}, err
		}
	}
	t2 := time.Now()
	// Where a start's or restore's time goes (docs/vm.md, Figures):
	// jail and QEMU up to its QMP answering, cgroup join, loading the
	// stream, cont.
	defer func() {
		d.log.DebugContext(ctx, "boot phases", "id", st.ID, "spawn", tSpawn, "cgroup", t1.Sub(t0)-tSpawn,
			"incoming", t2.Sub(t1), "cont", time.Since(t2), "shared_ram", ram != nil)
	}()
	if err := d.execute(ctx, st, "cont", nil, nil); err != nil {
		return runtime.State{}, fmt.Errorf("cont: %w%s", err, logTail(p.Log))
	}
	out, err := d.status(ctx, st)
	if err == nil && out.Status != runtime.StatusRunning {
		err = fmt.Errorf("QEMU is %s right after cont: %w%s", out.Status, errdefs.ErrUnavailable, logTail(p.Log))
	}
	return out, err
}

// startTimeout bounds how long QEMU may take to answer QMP after exec on
// an idle host; it is stretched by the load (hostload.Scale).
const startTimeout = 30 * time.Second

// started is a QEMU the driver just spawned: an exit channel while this
// process is its parent, and for a restore the zstd feeding its stream.
type started struct {
	exited   chan struct{}
	proc     *os.Process // the jail helper, then QEMU (it execs in place)
	inFD     int         // the migration stream's fd number inside QEMU
	unzstd   *exec.Cmd   // zstd -dc writing into that stream
	unzstdCh chan error
}

// kill ends the child of a failed boot and waits until it is reaped.
// Until the helper has exec'd QEMU its command line names no VM, so
// destroy's alive() would take it for gone while it still creates its
// jail under the state dir; the handle is ours and cannot name a reused
// pid.
func (q *started) kill(timeout time.Duration) {
	if q.proc == nil || q.exited == nil {
		return
	}
	_ = q.proc.Kill()
	select {
	case <-q.exited:
	case <-time.After(timeout):
	}
}

// release ends the decompressor if it still runs (a failed restore).
func (q *started) release() {
	if q.unzstd == nil {
		return
	}
	select {
	case err := <-q.unzstdCh:
		q.unzstdCh <- err
	default:
		_ = q.unzstd.Process.Kill()
		q.unzstdCh <- <-q.unzstdCh
	}
}

// spawn starts QEMU through the jail helper (jail.go) with every file it
// uses already open, and returns once it answers QMP (initialised:
// devices set up, vCPUs stopped by -S). QEMU is the driver's child, in a
// session of its own and holding no pipe of ours, so it outlives cubelet;
// a goroutine reaps it while this process lives (afterwards init does).
func (d *Driver) spawn(ctx context.Context, st *vmState, s runtime.Spec, p paths, image string, ram *os.File) (*started, error) {
	_ = os.Remove(p.Log)
	logf, err := os.OpenFile(p.Log, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	var files []*os.File
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	// Inherited descriptors are numbered from 3 in the order added.
	add := func(f *os.File) int { files = append(files, f); return 2 + len(files) }
	fds := &qemuFDs{Name: nameMarker(s.BundleDir)}
	for _, l := range []struct {
		path string
		fd   *int
	}{{p.QMP, &fds.QMP}, {p.Agent, &fds.Agent}} {
		f, err := listenUnix(l.path)
		if err != nil {
			return nil, err
		}
		*l.fd = add(f)
	}
	disk, err := os.OpenFile(p.Disk, os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("open disk: %w", err)
	}
	fds.Disk = add(disk)
	_ = os.Remove(p.Console)
	con, err := os.OpenFile(p.Console, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open console log: %w", err)
	}
	fds.Console = add(con)
	q := &started{}
	if image != "" {
		r, err := q.decompress(image, logf)
		if err != nil {
			return nil, err
		}
		q.inFD = add(r)
	}
	switch {
	case ram != nil:
		// A clone: the template's sealed memfd, mapped privately.
		dup, err := dupFile(ram)
		if err != nil {
			return nil, err
		}
		fds.RAM = add(dup)
	case st.Shape.SharedRAM:
		// A template VM: its own RAM file, mapped shared.
		f, err := createRAMFile(sharedRAMPath(st.Bundle), st.Shape.MemoryMiB<<20, st.UID)
		if err != nil {
			return nil, err
		}
		fds.RAM = add(f)
		p.ShareRAM = true
	}
	spec := jailSpec{
		Dir: filepath.Join(d.stateDir(st.ID), "jail"), UID: st.UID, GID: st.UID, NetNS: -1,
		Binds: append(append([]jailBind{}, d.jailBinds...), d.jailExtra...),
		Nodes: []jailNode{{Path: "/dev/null", Major: 1, Minor: 3, Mode: 0o666}, {Path: "/dev/urandom", Major: 1, Minor: 9, Mode: 0o666}},
		Proc:  fds.RAM > 0,
	}
	if loadsKernel(st.Shape, image != "") {
		spec.Binds = append(spec.Binds, jailBind{From: st.Shape.Kernel, To: jailKernel})
		if st.Shape.Initrd != "" {
			spec.Binds = append(spec.Binds, jailBind{From: st.Shape.Initrd, To: jailInitrd})
		}
	}
	if st.Shape.Accel == "kvm" {
		major, minor, err := charDev("/dev/kvm")
		if err != nil {
			return q, err
		}
		spec.Nodes = append(spec.Nodes, jailNode{Path: "/dev/kvm", Major: major, Minor: minor, Mode: 0o600, Own: true})
	}
	cloneflags := uintptr(syscall.CLONE_NEWNS | syscall.CLONE_NEWIPC | syscall.CLONE_NEWUTS)
	if s.NetNSPath != "" {
		ns, err := os.Open(s.NetNSPath)
		if err != nil {
			return q, fmt.Errorf("network namespace: %w", err)
		}
		spec.NetNS = add(ns)
	} else {
		// No NIC: an empty network namespace, so QEMU reaches no host
		// socket (loopback services, abstract unix sockets).
		cloneflags |= syscall.CLONE_NEWNET
	}
	// Descriptors the helper opens itself follow the inherited ones.
	next := 3 + len(files)
	if st.Shape.has("virtio-net") {
		spec.Tap, spec.TapFD, fds.Tap = tapName, next, next
		next++
		if st.Shape.has("vhost-net") {
			spec.Opens = append(spec.Opens, jailOpen{Path: "/dev/vhost-net", FD: next})
			fds.VhostNet = next
			next++
		}
	}
	if st.Shape.has("vhost-vsock") {
		spec.Opens = append(spec.Opens, jailOpen{Path: "/dev/vhost-vsock", FD: next})
		fds.Vsock = next
	}
	p.FDs = fds
	if st.Shape.Accel == "tcg" {
		spec.Env, spec.NoTHP = qemuTCGEnv, qemuNoTHP
	}
	spec.Exec = d.qemuReal
	spec.Argv = append([]string{d.qemuReal}, qemuArgs(st.Shape, p, image != "")...)
	if err := os.Mkdir(spec.Dir, 0o700); err != nil {
		return q, err
	}
	arg, err := json.Marshal(spec)
	if err != nil {
		return q, err
	}
	cmd := &exec.Cmd{Path: "/proc/self/exe", Args: []string{jailArg0, string(arg)}, Env: []string{}}
	// A file, never a pipe: QEMU keeps stderr for its whole life.
	cmd.Stdout, cmd.Stderr, cmd.ExtraFiles = logf, logf, files
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Cloneflags: cloneflags}
	if err := cmd.Start(); err != nil {
		return q, fmt.Errorf("start qemu jail: %w", err)
	}
	st.PID = cmd.Process.Pid
	q.proc = cmd.Process
	q.exited = make(chan struct{})
	go func(id string, pid int) {
		_ = cmd.Wait()
		// A signal here is worth a line: SIGSYS is QEMU's seccomp
		// sandbox stopping a forbidden call.
		if ps := cmd.ProcessState; ps != nil && ps.ExitCode() != 0 {
			d.log.Warn("qemu exited", "id", id, "pid", pid, "status", ps.String())
		} else {
			d.log.Debug("qemu exited", "id", id, "pid", pid)
		}
		close(q.exited)
	}(st.ID, st.PID)
	if err := d.save(st); err != nil {
		return q, err
	}
	// Ours are copies: closed now, a QEMU that dies leaves no listener.
	for _, f := range files {
		f.Close()
	}
	files = nil
	return q, d.waitQMP(ctx, st, q, p.Log)
}

// waitQMP waits until QEMU answers QMP, or fails as soon as it exits.
func (d *Driver) waitQMP(ctx context.Context, st *vmState, q *started, log string) error {
	ctx, cancel := context.WithTimeout(ctx, hostload.Scale(startTimeout))
	defer cancel()
	dctx, dcancel := context.WithCancel(ctx)
	defer dcancel()
	go func() {
		select {
		case <-q.exited:
			dcancel()
		case <-dctx.Done():
		}
	}()
	for {
		c, err := qmp.Dial(dctx, st.QMP)
		if err == nil {
			c.Close()
			return nil
		}
		select {
		case <-q.exited:
			return fmt.Errorf("qemu exited while starting: %w%s", errdefs.ErrInternal, logTail(log))
		case <-ctx.Done():
			return fmt.Errorf("qemu does not answer QMP: %w%s", ctx.Err(), logTail(log))
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// listenUnix binds and listens on a unix socket at path for QEMU to
// inherit: the socket file stays root's, QEMU only gets the descriptor.
func listenUnix(path string) (*os.File, error) {
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, err
	}
	l.SetUnlinkOnClose(false)
	f, err := l.File()
	l.Close()
	return f, err
}

// decompress starts "zstd -dc image" (as root, in the host: it only reads
// the image the driver wrote) and returns the read end of its output,
// for QEMU's incoming migration.
func (q *started) decompress(image string, logf *os.File) (*os.File, error) {
	in, err := os.Open(image)
	if err != nil {
		return nil, err
	}
	defer in.Close()
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer w.Close()
	cmd := exec.Command("zstd", "-dc", "-q")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = in, w, logf
	if err := cmd.Start(); err != nil {
		r.Close()
		return nil, fmt.Errorf("zstd: %w", err)
	}
	q.unzstd, q.unzstdCh = cmd, make(chan error, 1)
	go func() { q.unzstdCh <- cmd.Wait() }()
	return r, nil
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
