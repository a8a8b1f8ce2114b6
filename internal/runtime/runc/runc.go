// Package runc is the runtime.Driver for Linux containers, driven through
// the runc CLI with github.com/containerd/go-runc.
//
// Every sandbox is one runc container whose bundle is Spec.BundleDir:
//
//	BundleDir/config.json  OCI spec built by ocispec.For
//	BundleDir/console.log  stdout+stderr of PID 1 (a file, never a pipe to us)
//	BundleDir/init.pid     host PID of PID 1, written by runc
//	BundleDir/runc.log     runc's own JSON log for the last start
//
// runc keeps the container's state under Config.Root, which is what lets a
// restarted cubelet List and Stop sandboxes it did not start itself.
//
// Every sandbox runs in a user namespace of its own, its root an
// unprivileged block of host IDs, on an idmapped view of Spec.RootFS
// (userns.go; docs/security.md):
//
//	/run/cube/userns.json          the host's blocks in use, by runc root and sandbox ID
//	<Root>-userns/<id>/rootfs      idmapped view of Spec.RootFS (runc's root.path)
//	<Root>-userns/<id>/sys         sysfs of Spec.NetNSPath's network namespace
//	<Root>-userns/<id>/launch/<n>  during a start only: where a bind source the
//	                               launch namespace lacks is mounted there (launchns.go)
package runc

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	gorunc "github.com/containerd/go-runc"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/cgroups"
	"github.com/cubesandbox/cube/internal/runtime/ocispec"
)

// cgroupRemoveTimeout bounds how long Stop waits for the kernel to release
// a cgroup whose last task was just killed.
const cgroupRemoveTimeout = 2 * time.Second

// Config configures a Driver.
type Config struct {
	Binary string       // runc executable; "runc" (from PATH) when empty
	Root   string       // runc --root, e.g. /run/cube/runc; required
	Logger *slog.Logger // slog.Default() when nil
	// UserNS: every sandbox's user namespace (userns.go).
	UserNS UserNS
}

// Driver runs sandboxes as runc containers. It keeps no in-memory state:
// everything it needs lives in runc's root, next to it and in each
// bundle, so any number of Drivers (and processes) may share one Root.
type Driver struct {
	rc  *gorunc.Runc // never mutated after New; copied per call when a call needs its own log
	log *slog.Logger
	uns *usernsState
	// specHook, when set, changes the spec right before the bundle is
	// written. Only tests set it: controls take one protection away.
	specHook func(*specs.Spec)
	// freezers caches each container's cgroup paths for freeze (id ->
	// map[string]string).
	freezers sync.Map
	// launch is the mount namespace runc starts from (launchns.go); nil
	// when it could not be made, and runc starts from this process's.
	launch *launchNS
}

var _ runtime.Driver = (*Driver)(nil)

// New checks that the runc binary exists and creates Root.
func New(cfg Config) (*Driver, error) {
	if cfg.Root == "" || !filepath.IsAbs(cfg.Root) {
		return nil, fmt.Errorf("runc: root %q must be an absolute path: %w", cfg.Root, errdefs.ErrInvalidArgument)
	}
	bin := cfg.Binary
	if bin == "" {
		bin = "runc"
	}
	path, err := exec.LookPath(bin)
	if err != nil {
		return nil, fmt.Errorf("runc: %w: %w", errdefs.ErrUnavailable, err)
	}
	// Absolute: runc runs with / as its working directory in the launch
	// namespace.
	if path, err = filepath.Abs(path); err != nil {
		return nil, fmt.Errorf("runc: %w", err)
	}
	if err := os.MkdirAll(cfg.Root, 0o700); err != nil {
		return nil, fmt.Errorf("runc: create root: %w", err)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	log = log.With("runtime", "runc")
	uns, err := newUsernsState(cfg.Root, cfg.UserNS, log)
	if err != nil {
		return nil, err
	}
	keep := []string{path, cfg.Root}
	if !uns.cfg.Disabled {
		keep = append(keep, uns.cfg.MountDir)
	}
	launch, err := newLaunchNS(keep, log)
	if err == nil {
		// runc's libraries may lie on a mount the namespace does not keep.
		if verr := launch.in(exec.Command(path, "--version").Run); verr != nil {
			launch.close()
			launch, err = nil, fmt.Errorf("runc --version there: %w", verr)
		}
	}
	if err != nil {
		log.Warn("runc starts from this process's mount namespace: creates slow down as the host's mounts grow", "error", err)
	}
	return &Driver{
		launch: launch,
		rc: &gorunc.Runc{
			Command: path,
			Root:    cfg.Root,
			// Own process group, and no PdeathSignal: a signal aimed at
			// cubelet's group, or cubelet dying, must not reach runc
			// while it is between fork and detach.
			Setpgid: true,
		},
		log: log,
		uns: uns,
	}, nil
}

// Name implements runtime.Driver.
func (d *Driver) Name() string { return "runc" }

// Capabilities implements runtime.Driver. Checkpoint and restore need CRIU,
// which cannot run on the kernels this project targets.
func (d *Driver) Capabilities() runtime.Capabilities {
	return runtime.Capabilities{Pause: true, PauseFreezes: true}
}

// Start implements runtime.Driver. On any failure it removes what runc
// created for s.ID, except when the failure is that s.ID already exists:
// that sandbox belongs to someone else and is left untouched.
func (d *Driver) Start(ctx context.Context, s runtime.Spec) (st runtime.State, err error) {
	begin := time.Now()
	d.forgetFreezer(s.ID)
	if err := ctx.Err(); err != nil {
		return runtime.State{}, fmt.Errorf("runc start %s: %w", s.ID, err)
	}
	spec, err := ocispec.For(s)
	if err != nil {
		return runtime.State{}, err
	}
	if !filepath.IsAbs(s.BundleDir) {
		return runtime.State{}, fmt.Errorf("runc start %s: BundleDir %q is not absolute: %w", s.ID, s.BundleDir, errdefs.ErrInvalidArgument)
	}
	// Check before touching the bundle: a duplicate Start with the same
	// BundleDir would otherwise truncate the running sandbox's config.
	// runc's state directory answers that; `runc state` would be a
	// fork/exec of runc (~10 ms on a busy node) on every create
	// (cube-bench, docs/bench.md).
	if _, err := os.Stat(filepath.Join(d.rc.Root, s.ID)); err == nil {
		return runtime.State{}, fmt.Errorf("runc start %s: %w", s.ID, errdefs.ErrAlreadyExists)
	} else if !errors.Is(err, os.ErrNotExist) {
		return runtime.State{}, fmt.Errorf("runc start %s: %w", s.ID, err)
	}

	allowUnprivilegedPing(spec)
	if fitRlimits(spec) {
		d.log.WarnContext(ctx, "rlimits lowered to this process's hard limits (no CAP_SYS_RESOURCE)", "id", s.ID)
	}
	prep, err := d.uns.prepare(ctx, s, spec)
	if err != nil {
		return runtime.State{}, fmt.Errorf("runc start %s: %w", s.ID, err)
	}
	defer prep.close()
	ran := false // once runc ran, the rollback below releases the namespace
	defer func() {
		if err != nil && !ran {
			if rerr := d.uns.release(context.WithoutCancel(ctx), s.ID); rerr != nil {
				err = errors.Join(err, rerr)
			}
		}
	}()
	// A user namespace's root must reach the bind's source: its own
	// directory; without one, runc is host root and the bundle will do.
	maskDir := s.BundleDir
	if !d.uns.cfg.Disabled {
		maskDir = d.uns.dir(s.ID)
	}
	empty := filepath.Join(maskDir, "masked")
	late := deferMounts(spec, empty)
	if err := bindMaskedDirs(spec, empty, len(late.procDirs) > 0); err != nil {
		return runtime.State{}, fmt.Errorf("runc start %s: %w", s.ID, err)
	}
	if d.specHook != nil {
		d.specHook(spec)
	}
	if err := os.MkdirAll(s.BundleDir, 0o700); err != nil {
		return runtime.State{}, fmt.Errorf("runc start %s: %w", s.ID, err)
	}
	var launch *launchPlan
	if d.launch != nil {
		var why string
		launch, why, err = d.launch.plan(spec, filepath.Join(maskDir, "launch"), []string{s.BundleDir})
		if err != nil {
			return runtime.State{}, fmt.Errorf("runc start %s: %w", s.ID, err)
		}
		if why != "" {
			d.log.WarnContext(ctx, "runc starts from this process's mount namespace", "id", s.ID, "reason", why)
		}
		defer launch.close()
	}
	if err := writeBundle(s.BundleDir, spec); err != nil {
		return runtime.State{}, fmt.Errorf("runc start %s: %w", s.ID, err)
	}
	console, err := os.OpenFile(filepath.Join(s.BundleDir, "console.log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return runtime.State{}, fmt.Errorf("runc start %s: %w", s.ID, err)
	}
	// runc and PID 1 get their own copies of the descriptor at fork.
	defer console.Close()

	pidFile := filepath.Join(s.BundleDir, "init.pid")
	runcLog := filepath.Join(s.BundleDir, "runc.log")
	for _, f := range []string{pidFile, runcLog} {
		if err := os.Remove(f); err != nil && !errors.Is(err, os.ErrNotExist) {
			return runtime.State{}, fmt.Errorf("runc start %s: %w", s.ID, err)
		}
	}
	rc := *d.rc
	rc.Log, rc.LogFormat = runcLog, gorunc.JSON

	ran = true
	run := func() error {
		_, err := rc.Run(ctx, s.ID, s.BundleDir, &gorunc.CreateOpts{
			IO:      fileIO{console},
			PidFile: pidFile,
			Detach:  true,
		})
		return err
	}
	switch {
	case launch != nil:
		err = launch.run(prep.netns, run)
	case prep.netns != "":
		// runc and the sandbox get the network namespace by birth
		// (prepare says why runc cannot join it).
		err = inNetNS(prep.netns, run)
	default:
		err = run()
	}
	var pid int
	if err == nil {
		pid, err = readPid(pidFile)
	}
	if err != nil {
		err = d.classify(ctx, "run", s.ID, err, lastLogError(runcLog))
	} else if err = lateApply(ctx, late, pid); err != nil {
		err = fmt.Errorf("runc start %s: %w: %w", s.ID, err, errdefs.ErrInternal)
	} else {
		st = runtime.State{ID: s.ID, PID: pid, Status: runtime.StatusRunning, Created: time.Now()}
		d.log.DebugContext(ctx, "started", "id", s.ID, "pid", pid, "took", time.Since(begin))
		return st, nil
	}
	if !errdefs.IsAlreadyExists(err) {
		// Detached from ctx: the caller's ctx may be the very reason we
		// are here, and the rollback must still run to completion.
		cctx := context.WithoutCancel(ctx)
		cerr := d.destroy(cctx, s.ID, spec.Linux.CgroupsPath)
		if cerr == nil {
			cerr = d.uns.release(cctx, s.ID)
		}
		if cerr != nil {
			d.log.WarnContext(ctx, "rollback of failed start", "id", s.ID, "error", cerr)
			err = errors.Join(err, cerr)
		}
	}
	return runtime.State{}, err
}

// Restore implements runtime.Driver; runc cannot restore without CRIU.
func (d *Driver) Restore(context.Context, runtime.Spec, string) (runtime.State, error) {
	return runtime.State{}, fmt.Errorf("runc restore: %w", errdefs.ErrNotImplemented)
}

// Checkpoint implements runtime.Driver; runc cannot checkpoint without CRIU.
func (d *Driver) Checkpoint(context.Context, string, string, bool) error {
	return fmt.Errorf("runc checkpoint: %w", errdefs.ErrNotImplemented)
}

// Pause freezes every process of the sandbox (cgroup freezer).
func (d *Driver) Pause(ctx context.Context, id string) error {
	begin := time.Now()
	if err := d.freeze(ctx, id, true); err != nil {
		if !errors.Is(err, errNoFreezer) {
			return fmt.Errorf("pause %s: %w", id, err)
		}
		if err := d.launch.in(func() error { return d.rc.Pause(ctx, id) }); err != nil {
			return d.classify(ctx, "pause", id, err, "")
		}
	}
	d.log.DebugContext(ctx, "paused", "id", id, "took", time.Since(begin))
	return nil
}

var _ runtime.LimitUpdater = (*Driver)(nil)

// UpdateLimits sets a running or frozen sandbox's CPU, memory and PID
// limits (runc update): its cgroup takes them at once.
func (d *Driver) UpdateLimits(ctx context.Context, id string, l runtime.Limits) error {
	if err := d.launch.in(func() error { return d.rc.Update(ctx, id, ocispec.Limits(l)) }); err != nil {
		return d.classify(ctx, "update", id, err, "")
	}
	return nil
}

// Resume thaws a paused sandbox.
func (d *Driver) Resume(ctx context.Context, id string) error {
	begin := time.Now()
	if err := d.freeze(ctx, id, false); err != nil {
		if !errors.Is(err, errNoFreezer) {
			return fmt.Errorf("resume %s: %w", id, err)
		}
		if err := d.launch.in(func() error { return d.rc.Resume(ctx, id) }); err != nil {
			return d.classify(ctx, "resume", id, err, "")
		}
	}
	d.log.DebugContext(ctx, "resumed", "id", id, "took", time.Since(begin))
	return nil
}

// Stop kills every process of the sandbox, waits (bounded by ctx) for PID 1
// to exit, and removes runc's state and the cgroup in every hierarchy.
// Stopping an absent sandbox is a no-op.
func (d *Driver) Stop(ctx context.Context, id string) error {
	begin := time.Now()
	d.forgetFreezer(id)
	c, err := d.state(ctx, id)
	if err != nil {
		err = d.classify(ctx, "state", id, err, "")
		if !errdefs.IsNotFound(err) {
			return err
		}
		// runc cannot see a container whose create was interrupted
		// before state.json was written, yet its directory blocks the
		// ID; delete --force clears it and is a no-op otherwise.
		if derr := d.delete(ctx, id); derr != nil {
			return d.classify(ctx, "delete", id, derr, "")
		}
		return d.uns.release(ctx, id)
	}
	cgroupPath := cgroupPathFromBundle(c.Bundle)

	var pidfd = -1
	if c.Pid > 0 && c.Status != "stopped" {
		// Opened before the kill so the wait below cannot confuse PID 1
		// with an unrelated process that reuses its PID.
		if fd, err := unix.PidfdOpen(c.Pid, 0); err == nil {
			pidfd = fd
			defer unix.Close(fd)
		}
	}
	if err := d.launch.in(func() error {
		return d.rc.Kill(ctx, id, int(unix.SIGKILL), &gorunc.KillOpts{All: true})
	}); err != nil {
		if err := d.classify(ctx, "kill", id, err, ""); !errdefs.IsFailedPrecondition(err) && !errdefs.IsNotFound(err) {
			return err
		}
	}
	if pidfd >= 0 {
		if err := waitPidfd(ctx, pidfd); err != nil {
			return fmt.Errorf("runc stop %s: wait for pid %d: %w", id, c.Pid, err)
		}
	}
	if err := d.destroy(ctx, id, cgroupPath); err != nil {
		return err
	}
	if err := d.uns.release(ctx, id); err != nil {
		return fmt.Errorf("runc stop %s: %w", id, err)
	}
	d.log.DebugContext(ctx, "stopped", "id", id, "took", time.Since(begin))
	return nil
}

// destroy removes runc's state for id and then cgroupPath everywhere.
func (d *Driver) destroy(ctx context.Context, id, cgroupPath string) error {
	if err := d.delete(ctx, id); err != nil {
		if err := d.classify(ctx, "delete", id, err, ""); !errdefs.IsNotFound(err) {
			return err
		}
	}
	if cgroupPath == "" {
		return nil
	}
	left, err := cgroups.Remove(cgroupPath, cgroupRemoveTimeout)
	if len(left) > 0 {
		d.log.DebugContext(ctx, "removed cgroup dirs runc left behind", "id", id, "dirs", left)
	}
	if err != nil {
		return fmt.Errorf("runc stop %s: %w", id, err)
	}
	return nil
}

func (d *Driver) state(ctx context.Context, id string) (c *gorunc.Container, err error) {
	err = d.launch.in(func() error {
		c, err = d.rc.State(ctx, id)
		return err
	})
	return c, err
}

func (d *Driver) delete(ctx context.Context, id string) error {
	return d.launch.in(func() error { return d.rc.Delete(ctx, id, &gorunc.DeleteOpts{Force: true}) })
}

// State implements runtime.Driver.
func (d *Driver) State(ctx context.Context, id string) (runtime.State, error) {
	c, err := d.state(ctx, id)
	if err != nil {
		return runtime.State{}, d.classify(ctx, "state", id, err, "")
	}
	return toState(c), nil
}

// List implements runtime.Driver. It reads runc's root, so it also returns
// sandboxes started by other processes sharing Config.Root.
func (d *Driver) List(ctx context.Context) ([]runtime.State, error) {
	var cs []*gorunc.Container
	err := d.launch.in(func() (err error) {
		cs, err = d.rc.List(ctx)
		return err
	})
	if err != nil {
		return nil, d.classify(ctx, "list", "", err, "")
	}
	out := make([]runtime.State, 0, len(cs))
	for _, c := range cs {
		out = append(out, toState(c))
	}
	return out, nil
}

func toState(c *gorunc.Container) runtime.State {
	st := runtime.State{ID: c.ID, PID: c.Pid, Created: c.Created}
	switch c.Status {
	case "running":
		st.Status = runtime.StatusRunning
	case "paused", "pausing":
		st.Status = runtime.StatusPaused
	case "stopped":
		st.Status = runtime.StatusStopped
	case "created":
		st.Status = runtime.StatusCreated
	default:
		st.Status = runtime.Status(c.Status)
	}
	return st
}

// classify maps a runc failure onto errdefs. runc reports everything as
// exit status 1 with a message, so the message is all there is to go by;
// the phrases below are libcontainer's error strings.
func (d *Driver) classify(ctx context.Context, verb, id string, err error, detail string) error {
	msg := err.Error()
	if detail != "" {
		msg += ": " + detail
	}
	if cerr := ctx.Err(); cerr != nil {
		return fmt.Errorf("runc %s %s: %w: %s", verb, id, cerr, msg)
	}
	var kind error
	switch {
	case strings.Contains(msg, "does not exist"):
		kind = errdefs.ErrNotFound
	case strings.Contains(msg, "already exists"):
		kind = errdefs.ErrAlreadyExists
	case strings.Contains(msg, "not running"), strings.Contains(msg, "not paused"),
		strings.Contains(msg, "is stopped"), strings.Contains(msg, "is paused"):
		kind = errdefs.ErrFailedPrecondition
	default:
		kind = errdefs.ErrInternal
	}
	return fmt.Errorf("runc %s %s: %w: %s", verb, id, kind, strings.TrimSpace(msg))
}

func writeBundle(dir string, spec *specs.Spec) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	b, err := json.MarshalIndent(spec, "", "\t")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "config.json"), b, 0o600)
}

func readPid(path string) (int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 {
		return 0, fmt.Errorf("bad pid file %s: %q", path, b)
	}
	return pid, nil
}

// cgroupPathFromBundle recovers the sandbox's cgroup from the config.json
// written at Start, so Stop works for sandboxes of a previous process.
func cgroupPathFromBundle(bundle string) string {
	b, err := os.ReadFile(filepath.Join(bundle, "config.json"))
	if err != nil {
		return ""
	}
	var sp specs.Spec
	if json.Unmarshal(b, &sp) != nil || sp.Linux == nil {
		return ""
	}
	return sp.Linux.CgroupsPath
}

// lastLogError returns the last error message in runc's JSON log, which is
// the only place a detached run's failure reason ends up besides the
// container's console.
func lastLogError(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	var last string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var e struct{ Level, Msg string }
		if json.Unmarshal(sc.Bytes(), &e) == nil && (e.Level == "error" || e.Level == "fatal") {
			last = e.Msg
		}
	}
	return last
}

// waitPidfd waits until the process behind pidfd has exited (it becomes
// readable then, zombie or reaped alike) or ctx is done.
func waitPidfd(ctx context.Context, pidfd int) error {
	fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
	for {
		n, err := unix.Poll(fds, 20)
		if err != nil && !errors.Is(err, unix.EINTR) {
			return err
		}
		if n > 0 {
			return nil
		}
		if err := ctx.Err(); err != nil {
			return err
		}
	}
}

// fileIO hands runc (and through it PID 1) a plain file for stdout and
// stderr, so no pipe ties the sandbox to this process's lifetime.
type fileIO struct{ f *os.File }

func (fileIO) Close() error          { return nil }
func (fileIO) Stdin() io.WriteCloser { return nil }
func (fileIO) Stdout() io.ReadCloser { return nil }
func (fileIO) Stderr() io.ReadCloser { return nil }
func (o fileIO) Set(cmd *exec.Cmd)   { cmd.Stdout, cmd.Stderr = o.f, o.f }

// allowUnprivilegedPing lets every group of the sandbox open ICMP datagram
// sockets in its network namespace: ping keeps working although the
// sandbox has no CAP_NET_RAW (raw sockets forge packets). The sysctl is
// per network namespace; runc refuses it only in the host's, which a
// sandbox never joins.
func allowUnprivilegedPing(spec *specs.Spec) {
	if spec.Linux.Sysctl == nil {
		spec.Linux.Sysctl = map[string]string{}
	}
	spec.Linux.Sysctl["net.ipv4.ping_group_range"] = "0 2147483647"
}

var _ runtime.Prober = (*Driver)(nil)

// Probe checks runc's binary and root without running runc.
func (d *Driver) Probe(context.Context) error { return runtime.ProbeFiles(d.rc.Root, d.rc.Command) }
