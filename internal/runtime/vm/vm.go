// Package vm is the runtime.Driver for QEMU micro-VMs (-M microvm). It
// uses KVM where /dev/kvm works and TCG otherwise, and reports which
// (Driver.Accel). docs/vm.md explains the command line and the snapshots.
//
// Every VM is one QEMU process, confined (jail.go): its own uid (uid.go),
// no capabilities, no_new_privs, QEMU's seccomp sandbox, and a mount
// namespace whose root holds only QEMU, its libraries and the guest
// kernel. Every file it uses is a descriptor the driver passes in:
//
//	Root/<id>/state.json  pid, uid, bundle, sockets, accel, shape (List/State/
//	                      Stop work for VMs an earlier cubelet process started)
//	Bundle/qmp.sock       QMP (one client at a time; the driver connects per call)
//	Bundle/agent.sock     the agent channel (virtio-serial chardev)
//	Bundle/console.log    the guest's serial console
//	Bundle/qemu.log       QEMU's stderr (quoted in errors)
//
// Lifecycle (QMP status in brackets):
//
//	Start:   jail helper -> qemu -S -> QMP answers -> cgroup join -> cont [running]
//	Pause:   stop                                              [paused]
//	Resume:  cont                                              [running]
//	Checkpoint: stop -> getfd + migrate fd: (pipe to zstd) -> (cont | quit)
//	Restore: qemu -S -incoming defer (pipe from zstd) -> cgroup join ->
//	         migrate-incoming fd: -> cont
//	Stop:    quit (short timeout) -> SIGKILL -> remove files, uid and cgroup
package vm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/hostload"
	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/qmp"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/cgroups"
)

const tapName = network.TapName

// Timeouts of the driver's own steps. The QMP ones are for an idle host:
// QEMU answers its monitor from its main loop, which a loaded host runs
// late, so they are stretched by the load (hostload.Scale, docs/timeouts.md).
const (
	qmpTimeout          = 5 * time.Second
	quitTimeout         = 2 * time.Second
	killTimeout         = 5 * time.Second
	cgroupRemoveTimeout = 2 * time.Second
)

// Config configures a Driver.
type Config struct {
	QEMU     string // qemu-system-x86_64 (from PATH) when empty
	GuestDir string // vmguest artifacts; /var/lib/cube/vm when empty
	// Accel is "auto" (KVM when /dev/kvm opens and KVM_CREATE_VM works,
	// else TCG), "kvm" or "tcg".
	Accel string
	Root  string // driver state, one directory per VM; required, absolute
	// DefaultMemoryMiB is the guest RAM when Limits.MemoryMiB is 0 (256).
	DefaultMemoryMiB int64
	// Vhost asks for vhost-net on the TAP; honoured only where
	// /dev/vhost-net exists (QEMU aborts with vhost=on elsewhere).
	Vhost bool
	// ExtraCmdline is appended to the guest kernel command line (e.g.
	// "loglevel=7" while debugging a boot).
	ExtraCmdline []string
	// UIDBase and UIDCount are the host uids (and gids) VMs' QEMUs run
	// as, one each (uid.go); DefaultUIDBase/DefaultUIDCount when 0.
	// UIDDir holds their allocation, shared by every driver of the host
	// (DefaultUIDDir when empty).
	UIDBase, UIDCount uint32
	UIDDir            string
	Logger            *slog.Logger
}

// Driver runs VMs. It keeps no state in memory but a cache: Root and the
// bundles hold everything, and the sealed copies of template RAM files
// clones map (template.go) are made again after a restart.
type Driver struct {
	qemu, guestDir, accel, root string
	qemuReal                    string // qemu with symlinks resolved: its path in the jail
	defMem                      int64
	vhost, vsock                bool
	extra                       []string
	uids                        uidAlloc
	jailBinds                   []jailBind // QEMU, its libraries and firmware (qemuFiles)
	jailExtra                   []jailBind // tests only: a probe binary in the jail
	tmpl                        templateCache
	log                         *slog.Logger
}

var (
	_ runtime.Driver        = (*Driver)(nil)
	_ runtime.Describer     = (*Driver)(nil)
	_ runtime.ConsoleLogger = (*Driver)(nil)
	_ runtime.ConsoleSealer = (*Driver)(nil)
	_ runtime.MACReporter   = (*Driver)(nil)
)

// New resolves the accelerator and checks QEMU exists. The guest artifacts
// are loaded at each Start, so they can be built after cubelet starts.
func New(cfg Config) (*Driver, error) {
	if cfg.Root == "" || !filepath.IsAbs(cfg.Root) {
		return nil, fmt.Errorf("vm: root %q must be an absolute path: %w", cfg.Root, errdefs.ErrInvalidArgument)
	}
	bin := cfg.QEMU
	if bin == "" {
		bin = "qemu-system-x86_64"
	}
	path, err := lookPath(bin)
	if err != nil {
		return nil, fmt.Errorf("vm: %s: %w: %w", bin, errdefs.ErrUnavailable, err)
	}
	accel, err := pickAccel(cfg.Accel)
	if err != nil {
		return nil, err
	}
	if cfg.DefaultMemoryMiB < 0 {
		return nil, fmt.Errorf("vm: default memory %d MiB: %w", cfg.DefaultMemoryMiB, errdefs.ErrInvalidArgument)
	}
	if cfg.DefaultMemoryMiB == 0 {
		cfg.DefaultMemoryMiB = 256
	}
	if cfg.GuestDir == "" {
		cfg.GuestDir = "/var/lib/cube/vm"
	}
	if err := os.MkdirAll(cfg.Root, 0o700); err != nil {
		return nil, fmt.Errorf("vm: create root: %w", err)
	}
	if cfg.UIDBase == 0 {
		cfg.UIDBase = DefaultUIDBase
	}
	if cfg.UIDCount == 0 {
		cfg.UIDCount = DefaultUIDCount
	}
	if cfg.UIDDir == "" {
		cfg.UIDDir = DefaultUIDDir
	}
	if uint64(cfg.UIDBase)+uint64(cfg.UIDCount) > 1<<32-1 {
		return nil, fmt.Errorf("vm: uid range %d+%d: %w", cfg.UIDBase, cfg.UIDCount, errdefs.ErrInvalidArgument)
	}
	binds, err := qemuFiles(path)
	if err != nil {
		return nil, err
	}
	resolved, err := filepath.EvalSymlinks(path)
	if err != nil {
		return nil, fmt.Errorf("vm: %w", err)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	d := &Driver{
		qemu: path, qemuReal: resolved, guestDir: cfg.GuestDir, accel: accel, root: cfg.Root, defMem: cfg.DefaultMemoryMiB,
		uids: uidAlloc{dir: cfg.UIDDir, base: cfg.UIDBase, count: cfg.UIDCount}, jailBinds: binds,
		vhost: cfg.Vhost && exists("/dev/vhost-net"), vsock: exists("/dev/vhost-vsock"),
		extra: cfg.ExtraCmdline, log: log.With("runtime", "vm"),
	}
	d.log.Info("vm driver", "accel", accel, "qemu", path, "guest_dir", cfg.GuestDir, "vhost_net", d.vhost, "vsock", d.vsock,
		"uids", fmt.Sprintf("%d-%d", cfg.UIDBase, cfg.UIDBase+cfg.UIDCount-1))
	return d, nil
}

// Name implements runtime.Driver.
func (d *Driver) Name() string { return "vm" }

// Accel is the accelerator every VM of this driver uses: "kvm" or "tcg".
func (d *Driver) Accel() string { return d.accel }

// Vsock reports whether VMs get a vhost-vsock device (the agent is then
// also reachable at AgentCID), besides the virtio-serial channel.
func (d *Driver) Vsock() bool { return d.vsock }

// Capabilities implements runtime.Driver.
func (d *Driver) Capabilities() runtime.Capabilities {
	return runtime.Capabilities{Pause: true, Checkpoint: true, Restore: true, BootsDisk: true, SlotTAP: true}
}

// vmState is Root/<id>/state.json.
type vmState struct {
	ID      string `json:"id"`
	PID     int    `json:"pid"`
	Bundle  string `json:"bundle"`
	QMP     string `json:"qmp"`
	Agent   string `json:"agent"`
	Console string `json:"console"`
	Cgroup  string `json:"cgroup,omitempty"`
	Accel   string `json:"accel"`
	CID     uint32 `json:"vsock_cid,omitempty"`
	// UID is QEMU's uid and gid (uid.go), released when QEMU is gone.
	UID     uint32    `json:"uid,omitempty"`
	Started time.Time `json:"started"`
	Shape   Shape     `json:"shape"`
	// ShapeNote says how a restore's requested shape differed from the
	// snapshot's (the snapshot's wins).
	ShapeNote string `json:"shape_note,omitempty"`
}

func (d *Driver) stateDir(id string) string { return filepath.Join(d.root, id) }

func validID(id string) error {
	if id == "" || id == "." || id == ".." || strings.ContainsAny(id, "/\x00") {
		return fmt.Errorf("vm: sandbox id %q: %w", id, errdefs.ErrInvalidArgument)
	}
	return nil
}

func (d *Driver) load(id string) (*vmState, error) {
	if err := validID(id); err != nil {
		return nil, err
	}
	b, err := os.ReadFile(filepath.Join(d.stateDir(id), "state.json"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("vm %s: %w", id, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("vm %s: %w", id, err)
	}
	var st vmState
	if err := json.Unmarshal(b, &st); err != nil {
		return nil, fmt.Errorf("vm %s: state.json: %w", id, err)
	}
	return &st, nil
}

func (d *Driver) save(st *vmState) error {
	b, err := json.MarshalIndent(st, "", "  ")
	if err != nil {
		return err
	}
	tmp := filepath.Join(d.stateDir(st.ID), "state.json.tmp")
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(d.stateDir(st.ID), "state.json"))
}

// AgentSocket is the unix socket of id's agent channel (virtio-serial):
// agentchan.SerialClient(path) talks to cube-agent through it.
func (d *Driver) AgentSocket(id string) (string, error) {
	st, err := d.load(id)
	if err != nil {
		return "", err
	}
	return st.Agent, nil
}

// AgentCID is id's vsock CID, 0 when VMs have no vsock device.
func (d *Driver) AgentCID(id string) (uint32, error) {
	st, err := d.load(id)
	if err != nil {
		return 0, err
	}
	return st.CID, nil
}

// ConsoleLog is the file the guest's serial console is written to.
func (d *Driver) ConsoleLog(id string) (string, error) {
	st, err := d.load(id)
	if err != nil {
		return "", err
	}
	return st.Console, nil
}

// ShapeNote is non-empty when id was restored from a snapshot whose shape
// (vCPUs, memory) differs from what the restore asked for: the snapshot's
// shape is what runs, and callers should tell the user.
func (d *Driver) ShapeNote(id string) (string, error) {
	st, err := d.load(id)
	if err != nil {
		return "", err
	}
	return st.ShapeNote, nil
}

// alive reports whether st.PID is still st's QEMU: the pid may have been
// reused since, so its command line must name st's QMP socket.
func alive(st *vmState) bool {
	if st.PID <= 0 {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", st.PID))
	if err != nil {
		return false
	}
	// A jailed QEMU names its bundle in -name; one started before QEMU
	// was jailed names its QMP socket.
	cl := string(b)
	if !strings.Contains(cl, "\x00"+nameMarker(st.Bundle)+"\x00") && !strings.Contains(cl, "unix:"+st.QMP+",") {
		return false
	}
	// A zombie has a cmdline of "" on exit, but be explicit.
	s, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", st.PID))
	if err == nil {
		if i := strings.LastIndexByte(string(s), ')'); i > 0 && i+2 < len(s) && s[i+2] == 'Z' {
			return false
		}
	}
	return true
}

func (d *Driver) client(ctx context.Context, st *vmState) (*qmp.Client, error) {
	ctx, cancel := context.WithTimeout(ctx, hostload.Scale(qmpTimeout))
	defer cancel()
	return qmp.Dial(ctx, st.QMP)
}

// execute runs one QMP command on a fresh connection.
func (d *Driver) execute(ctx context.Context, st *vmState, cmd string, args, out any) error {
	c, err := d.client(ctx, st)
	if err != nil {
		return err
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(ctx, hostload.Scale(qmpTimeout))
	defer cancel()
	return c.Execute(ctx, cmd, args, out)
}

type statusInfo struct {
	Status  string `json:"status"`
	Running bool   `json:"running"`
}

func mapStatus(s statusInfo) runtime.Status {
	if s.Running {
		return runtime.StatusRunning
	}
	switch s.Status {
	case "shutdown", "guest-panicked", "internal-error", "io-error":
		return runtime.StatusStopped
	case "prelaunch":
		return runtime.StatusCreated
	}
	// paused, postmigrate, inmigrate, finish-migrate, suspended, ...
	return runtime.StatusPaused
}

func (d *Driver) status(ctx context.Context, st *vmState) (runtime.State, error) {
	out := runtime.State{ID: st.ID, PID: st.PID, Created: st.Started, Status: runtime.StatusStopped}
	if !alive(st) {
		return out, nil
	}
	var si statusInfo
	if err := d.execute(ctx, st, "query-status", nil, &si); err != nil {
		if !alive(st) {
			return out, nil
		}
		return runtime.State{}, fmt.Errorf("vm %s: query-status: %w", st.ID, err)
	}
	out.Status = mapStatus(si)
	return out, nil
}

// State implements runtime.Driver.
func (d *Driver) State(ctx context.Context, id string) (runtime.State, error) {
	st, err := d.load(id)
	if err != nil {
		return runtime.State{}, err
	}
	return d.status(ctx, st)
}

// List implements runtime.Driver.
func (d *Driver) List(ctx context.Context) ([]runtime.State, error) {
	ents, err := os.ReadDir(d.root)
	if err != nil {
		return nil, fmt.Errorf("vm list: %w", err)
	}
	var out []runtime.State
	for _, e := range ents {
		if !e.IsDir() {
			continue
		}
		s, err := d.State(ctx, e.Name())
		if errdefs.IsNotFound(err) {
			continue // being created or removed right now
		}
		if err != nil {
			// One VM whose QMP does not answer (hung, or busy in a long
			// migration) must not hide every other VM from reconcile:
			// report it from its process alone.
			st, lerr := d.load(e.Name())
			if lerr != nil {
				continue
			}
			d.log.WarnContext(ctx, "vm list: state unknown, reported from its process", "id", e.Name(), "error", err)
			s = runtime.State{ID: st.ID, PID: st.PID, Status: runtime.StatusStopped}
			if alive(st) {
				s.Status = runtime.StatusRunning
			}
		}
		out = append(out, s)
	}
	return out, nil
}

// Pause implements runtime.Driver (QMP stop: vCPUs halt, memory stays).
func (d *Driver) Pause(ctx context.Context, id string) error {
	return d.simple(ctx, id, "pause", "stop")
}

// Resume implements runtime.Driver (QMP cont).
func (d *Driver) Resume(ctx context.Context, id string) error {
	return d.simple(ctx, id, "resume", "cont")
}

func (d *Driver) simple(ctx context.Context, id, verb, cmd string) error {
	st, err := d.load(id)
	if err != nil {
		return fmt.Errorf("vm %s: %w", verb, err)
	}
	if !alive(st) {
		return fmt.Errorf("vm %s %s: QEMU is gone: %w", verb, id, errdefs.ErrFailedPrecondition)
	}
	if err := d.execute(ctx, st, cmd, nil, nil); err != nil {
		return fmt.Errorf("vm %s %s: %w", verb, id, err)
	}
	return nil
}

// Stop implements runtime.Driver: QMP quit, SIGKILL when QEMU does not
// exit in time, then the sockets, state and cgroup go.
func (d *Driver) Stop(ctx context.Context, id string) error {
	st, err := d.load(id)
	if errdefs.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("vm stop: %w", err)
	}
	return d.destroy(ctx, st)
}

// destroy ends st's QEMU and removes everything the driver made for it.
// It runs to the end whatever ctx says: a half-removed VM is a leak.
func (d *Driver) destroy(ctx context.Context, st *vmState) error {
	ctx = context.WithoutCancel(ctx)
	var errs []error
	if st.PID == 0 {
		// The state was saved before QEMU daemonized (a crash or failure
		// in between): QEMU's own pid file is the only trace of it.
		if pid, err := ReadPIDFile(filepath.Join(st.Bundle, "qemu.pid")); err == nil {
			st.PID = pid
		}
	}
	if alive(st) {
		qctx, cancel := context.WithTimeout(ctx, quitTimeout)
		c, err := qmp.Dial(qctx, st.QMP)
		if err == nil {
			err = c.Execute(qctx, "quit", nil, nil)
			c.Close()
		}
		cancel()
		if err == nil {
			// QEMU answered: it exits as soon as it has closed its files.
			err = waitGone(st, quitTimeout)
		}
		if err != nil {
			_ = syscall.Kill(st.PID, syscall.SIGKILL)
			if err := waitGone(st, killTimeout); err != nil {
				errs = append(errs, fmt.Errorf("vm %s: pid %d survives SIGKILL: %w", st.ID, st.PID, err))
			}
		}
	}
	if len(errs) == 0 {
		files := []string{st.QMP, st.Agent, filepath.Join(st.Bundle, "qemu.pid")}
		if st.Shape.SharedRAM {
			files = append(files, sharedRAMPath(st.Bundle))
		}
		for _, p := range files {
			if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
				errs = append(errs, err)
			}
		}
		if st.Cgroup != "" {
			if _, err := cgroups.Remove(st.Cgroup, cgroupRemoveTimeout); err != nil {
				errs = append(errs, err)
			}
		}
		// QEMU is gone: its uid may go to the next VM, once nothing runs
		// as it (alive trusts QEMU's own command line; the uid is the
		// kernel's word). Before the state dir, so a crash in between
		// leaves a file take() reclaims.
		if err := killUID(st.UID, killTimeout); err != nil {
			errs = append(errs, err)
		} else if err := d.uids.release(st.UID, d.stateDir(st.ID)); err != nil {
			errs = append(errs, err)
		}
		if err := os.RemoveAll(d.stateDir(st.ID)); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("vm stop %s: %w", st.ID, err)
	}
	d.log.DebugContext(ctx, "stopped", "id", st.ID, "pid", st.PID)
	return nil
}

// waitGone polls until st's QEMU has exited: "gone" is "not alive" (a
// QEMU from before a cubelet restart is not our child; one we started is
// reaped by its launcher's goroutine).
func waitGone(st *vmState, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for alive(st) {
		if time.Now().After(deadline) {
			return fmt.Errorf("still running after %s", timeout)
		}
		time.Sleep(5 * time.Millisecond)
	}
	return nil
}

var _ runtime.Prober = (*Driver)(nil)

// Probe checks QEMU's binary, the driver's root and, under KVM, that
// /dev/kvm is still there.
func (d *Driver) Probe(context.Context) error {
	if err := runtime.ProbeFiles(d.root, d.qemuReal); err != nil {
		return err
	}
	if d.accel == "kvm" {
		if _, err := os.Stat("/dev/kvm"); err != nil {
			return err
		}
	}
	return nil
}
