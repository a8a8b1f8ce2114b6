// Package gvisor is the runtime.Driver for gVisor sandboxes, driven through
// the runsc CLI with github.com/containerd/go-runc (runsc speaks runc's
// command line; the global flags runsc adds go in Runc.ExtraArgs).
//
// Every sandbox is one runsc container (under one of two runsc IDs, its
// slots: slots.go) whose bundle is Spec.BundleDir:
//
//	BundleDir/config.json  OCI spec (ocispec.For, adjusted for gVisor: SpecFor)
//	BundleDir/console.log  stdout+stderr of PID 1 (cube-agent's until it listens) and of runsc (a file, never a pipe)
//	BundleDir/runsc.log    runsc's own log for the last run/restore/checkpoint
//	BundleDir/debug/       runsc --debug-log output, only with Config.Debug
//
// runsc keeps its state under Config.Root, so a restarted cubelet can List
// and Stop sandboxes it did not start.
//
// Global flags: runsc decides the platform and the network stack from
// flags, not from the spec, and a later subcommand (checkpoint, restore,
// delete) must repeat the ones the sandbox was created with or it fails
// ("cannot run with network enabled in root network namespace"). The
// network mode is therefore derived from the bundle's config.json on every
// call: a spec naming a network namespace path runs with --network=sandbox
// (gVisor's netstack takes over that namespace's interfaces), any other
// with --network=none (loopback only). --network=host is never used: a
// hostinet sandbox cannot be checkpointed.
package gvisor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	gorunc "github.com/containerd/go-runc"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/cgroups"
)

// cgroupRemoveTimeout bounds how long Stop waits for the kernel to release
// a cgroup whose last task was just killed.
const cgroupRemoveTimeout = 2 * time.Second

// CheckpointFile is the memory image runsc writes into a checkpoint dir.
const CheckpointFile = "checkpoint.img"

// Config configures a Driver.
type Config struct {
	Binary   string // runsc executable; "runsc" (from PATH) when empty
	Root     string // runsc --root; required, absolute
	Platform string // runsc --platform; "ptrace" when empty (no KVM needed)
	// Debug passes --debug --debug-log=<bundle>/debug/ to run and restore:
	// the place to look when a sandbox dies right after start.
	Debug bool
	// Checkpoint enables Checkpoint and Restore (memory snapshots). Off,
	// they return ErrNotImplemented and Capabilities says so, and callers
	// fall back to disk-only snapshots. runsc 20221219 (Debian 12) cannot
	// save a sandbox in which a process waits on a TCP listener through
	// epoll (every Go server, cube-agent included: "endpoint still has
	// waiters upon save"), and the failed checkpoint kills the sandbox;
	// enable it with a runsc that can. See docs/gvisor.md.
	Checkpoint bool
	// SentryOverhead is the memory, in bytes, every sandbox's cgroup gets
	// above its guest's limit for the sentry and the gofer (memlimit.go):
	// 0 is DefaultSentryOverhead, NoSentryOverhead none.
	SentryOverhead int64
	Logger         *slog.Logger // slog.Default() when nil
}

// Driver runs sandboxes as runsc containers. Like the runc driver it keeps
// no in-memory state: runsc's root and each bundle hold everything.
type Driver struct {
	bin, root, platform string
	debug, checkpoint   bool
	overhead            int64 // sentry overhead, bytes (memlimit.go)
	log                 *slog.Logger
	// stateFormatOnce: the warning that readState fell back to runsc is
	// said once per driver.
	stateFormatOnce sync.Once
	// noControlOnce: the warning that pause or resume fell back to runsc
	// because the sentry's control socket was not usable.
	noControlOnce sync.Once
	// reaps are the background deletes of retired slots in flight, by
	// runsc ID (swap.go); Stop and the next swap wait for them.
	reapMu sync.Mutex
	reaps  map[string]chan struct{}
	// dying are the pidfds of the processes killed when a slot was
	// retired, by runsc ID (swap.go); the next launch into that slot
	// waits for them to exit, Stop closes them.
	dying map[string][]int
}

var (
	_ runtime.Driver          = (*Driver)(nil)
	_ runtime.Describer       = (*Driver)(nil)
	_ runtime.AgentWaker      = (*Driver)(nil)
	_ runtime.InPlaceRestorer = (*Driver)(nil)
	_ runtime.Reaper          = (*Driver)(nil)
)

// New checks that runsc exists and creates Root.
func New(cfg Config) (*Driver, error) {
	if cfg.Root == "" || !filepath.IsAbs(cfg.Root) {
		return nil, fmt.Errorf("gvisor: root %q must be an absolute path: %w", cfg.Root, errdefs.ErrInvalidArgument)
	}
	bin := cfg.Binary
	if bin == "" {
		bin = "runsc"
	}
	path, err := exec.LookPath(bin)
	if err != nil {
		return nil, fmt.Errorf("gvisor: %w: %w", errdefs.ErrUnavailable, err)
	}
	platform := cfg.Platform
	if platform == "" {
		platform = "ptrace"
	}
	switch platform {
	case "ptrace", "kvm", "systrap":
	default:
		return nil, fmt.Errorf("gvisor: platform %q: want ptrace, kvm or systrap: %w", platform, errdefs.ErrInvalidArgument)
	}
	overhead, err := sentryOverhead(cfg.SentryOverhead)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(cfg.Root, 0o700); err != nil {
		return nil, fmt.Errorf("gvisor: create root: %w", err)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	return &Driver{bin: path, root: cfg.Root, platform: platform, debug: cfg.Debug, checkpoint: cfg.Checkpoint, overhead: overhead, log: log.With("runtime", "gvisor")}, nil
}

// Name implements runtime.Driver.
func (d *Driver) Name() string { return "gvisor" }

// Capabilities implements runtime.Driver: runsc checkpoints and restores
// a whole sandbox, memory included, without CRIU (when Config.Checkpoint).
func (d *Driver) Capabilities() runtime.Capabilities {
	// PauseFreezes: the sentry's pause stops the sandbox's tasks in place
	// and its resume returns once they run again (setPaused).
	return runtime.Capabilities{Pause: true, PauseFreezes: true, Checkpoint: d.checkpoint, Restore: d.checkpoint, NeedsSlot: true}
}

func (d *Driver) memoryOff(verb, id string) error {
	if d.checkpoint {
		return nil
	}
	return fmt.Errorf("gvisor %s %s: memory snapshots are disabled ([gvisor] checkpoint): %w", verb, id, errdefs.ErrNotImplemented)
}

// rsc returns a go-runc handle for one call. network is "none" or
// "sandbox"; logFile, when set, receives runsc's own log.
func (d *Driver) rsc(network, logFile string) *gorunc.Runc {
	r := &gorunc.Runc{
		Command: d.bin,
		Root:    d.root,
		// Own process group and no PdeathSignal: cubelet dying must not
		// reach runsc between fork and detach.
		Setpgid:   true,
		ExtraArgs: []string{"--platform=" + d.platform, "--network=" + network},
	}
	if logFile != "" {
		r.Log = logFile
	}
	return r
}

// Start implements runtime.Driver.
func (d *Driver) Start(ctx context.Context, s runtime.Spec) (runtime.State, error) {
	if err := ctx.Err(); err != nil {
		return runtime.State{}, fmt.Errorf("gvisor start %s: %w", s.ID, err)
	}
	spec, err := d.specFor(s)
	if err != nil {
		return runtime.State{}, err
	}
	return d.launch(ctx, s.ID, s.BundleDir, spec, "")
}

// Restore implements runtime.Driver: a new sandbox from the memory image
// in dir (written by Checkpoint), on s.RootFS. The root filesystem must
// hold the files the checkpointed sandbox had open, which a CubeCoW clone
// of the disk taken while the sandbox was stopped does.
func (d *Driver) Restore(ctx context.Context, s runtime.Spec, dir string) (runtime.State, error) {
	if err := d.memoryOff("restore", s.ID); err != nil {
		return runtime.State{}, err
	}
	if !filepath.IsAbs(dir) {
		return runtime.State{}, fmt.Errorf("gvisor restore %s: image dir %q is not absolute: %w", s.ID, dir, errdefs.ErrInvalidArgument)
	}
	if _, err := os.Stat(filepath.Join(dir, CheckpointFile)); err != nil {
		return runtime.State{}, fmt.Errorf("gvisor restore %s: no memory image in %s: %w", s.ID, dir, errdefs.ErrNotFound)
	}
	spec, err := d.specFor(s)
	if err != nil {
		return runtime.State{}, err
	}
	return d.launch(ctx, s.ID, s.BundleDir, spec, dir)
}

// launch runs (image == "") or restores a new sandbox, in slot A. On any
// failure it removes what runsc created for s.ID, unless the failure is
// that s.ID exists already: that sandbox belongs to someone else.
func (d *Driver) launch(ctx context.Context, id, bundle string, spec *specs.Spec, image string) (runtime.State, error) {
	// Before touching the bundle: a duplicate would otherwise rewrite the
	// running sandbox's config.
	if _, err := d.State(ctx, id); err == nil {
		verb := "start"
		if image != "" {
			verb = "restore"
		}
		return runtime.State{}, fmt.Errorf("gvisor %s %s: %w", verb, id, errdefs.ErrAlreadyExists)
	} else if !errdefs.IsNotFound(err) {
		return runtime.State{}, err
	}
	return d.launchAs(ctx, id, slotIDs(id)[0], bundle, spec, image)
}

// launchAs runs or restores sandbox id as runsc ID rid (one of its slots,
// which must be free).
func (d *Driver) launchAs(ctx context.Context, id, rid, bundle string, spec *specs.Spec, image string) (runtime.State, error) {
	begin := time.Now()
	verb := "start"
	if image != "" {
		verb = "restore"
	}
	if err := ctx.Err(); err != nil {
		return runtime.State{}, fmt.Errorf("gvisor %s %s: %w", verb, id, err)
	}
	if !filepath.IsAbs(bundle) {
		return runtime.State{}, fmt.Errorf("gvisor %s %s: BundleDir %q is not absolute: %w", verb, id, bundle, errdefs.ErrInvalidArgument)
	}
	// The sandbox last retired from this slot must be gone: it holds the
	// slot's control socket until it exits.
	if err := d.awaitExit(ctx, rid); err != nil {
		return runtime.State{}, fmt.Errorf("gvisor %s %s: %w", verb, id, err)
	}
	if _, err := d.readSlot(ctx, id, rid); err == nil {
		return runtime.State{}, fmt.Errorf("gvisor %s %s: %s: %w", verb, id, rid, errdefs.ErrAlreadyExists)
	} else if !errdefs.IsNotFound(err) {
		return runtime.State{}, err
	}
	if err := writeBundle(bundle, spec); err != nil {
		return runtime.State{}, fmt.Errorf("gvisor %s %s: %w", verb, id, err)
	}
	if err := saveNet(spec, bundle); err != nil {
		return runtime.State{}, fmt.Errorf("gvisor %s %s: %w", verb, id, err)
	}
	console, err := os.OpenFile(filepath.Join(bundle, "console.log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return runtime.State{}, fmt.Errorf("gvisor %s %s: %w", verb, id, err)
	}
	// runsc and the sandbox get their own copies at fork.
	defer console.Close()
	logFile := filepath.Join(bundle, "runsc.log")
	_ = os.Remove(logFile)

	err = d.runDetached(ctx, rid, bundle, networkFor(spec), logFile, image, console)
	var st runtime.State
	if err == nil {
		var c *gorunc.Container
		if c, err = d.readSlot(ctx, id, rid); err == nil {
			st = toState(c)
		}
		// A detached run returns once the sandbox was started; under load
		// PID 1 can already be gone by then (a bad entrypoint, or the
		// sandbox killed while booting). Say so now, with the reason
		// runsc or PID 1 printed, instead of letting the caller wait for
		// an agent that will never answer.
		if err == nil && st.Status != runtime.StatusRunning {
			err = fmt.Errorf("gvisor %s %s: sandbox is %s right after %s: %w: %s",
				verb, id, st.Status, verb, errdefs.ErrUnavailable, tail(filepath.Join(bundle, "console.log"), 512))
		}
	}
	if err == nil {
		d.log.DebugContext(ctx, verb, "id", id, "pid", st.PID, "took", time.Since(begin))
		return st, nil
	}
	err = d.classify(ctx, verb, id, err, tail(logFile, 512))
	if !errdefs.IsAlreadyExists(err) {
		// Detached from ctx: the caller's ctx may be why we are here,
		// and the rollback must still finish (within its own bound).
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), launchBound)
		defer cancel()
		if cerr := d.destroy(rctx, id, rid, bundle, spec); cerr != nil {
			d.log.WarnContext(ctx, "rollback of failed "+verb, "id", id, "error", cerr)
			err = errors.Join(err, cerr)
		}
	}
	return runtime.State{}, err
}

// Pause freezes the sandbox (memory stays resident).
func (d *Driver) Pause(ctx context.Context, id string) error {
	c, rid, _, err := d.lookup(ctx, id)
	if err != nil {
		return err
	}
	return d.pauseSlot(ctx, id, rid, networkOf(c.Bundle), true)
}

// pauseSlot pauses or resumes slot rid directly (setPaused), or with
// runsc where the state file is in a layout setPaused does not know.
func (d *Driver) pauseSlot(ctx context.Context, id, rid, network string, paused bool) error {
	begin := time.Now()
	err := d.setPaused(ctx, id, rid, paused)
	verb := "resume"
	if paused {
		verb = "pause"
	}
	if errors.Is(err, errStateFormat) || errors.Is(err, errNoControl) {
		if errors.Is(err, errNoControl) {
			d.noControlOnce.Do(func() {
				d.log.WarnContext(ctx, "the sentry's control socket is not usable; pausing and resuming with runsc instead (slower)", "id", id, "error", err)
			})
		}
		if paused {
			err = d.rsc(network, "").Pause(ctx, rid)
		} else {
			err = d.rsc(network, "").Resume(ctx, rid)
		}
		if err != nil {
			return d.classify(ctx, verb, id, err, "")
		}
	}
	if err != nil {
		return err
	}
	d.log.DebugContext(ctx, verb, "id", id, "took", time.Since(begin))
	return nil
}

// Resume thaws a paused sandbox. In a network namespace it first takes
// the namespace's addresses away from the host kernel again (releaseAddrs).
func (d *Driver) Resume(ctx context.Context, id string) error {
	c, rid, _, err := d.lookup(ctx, id)
	if err != nil {
		return err
	}
	if sp, err := readSpec(c.Bundle); err == nil {
		if err := releaseAddrs(sp); err != nil {
			return fmt.Errorf("gvisor resume %s: %w", id, err)
		}
	}
	return d.pauseSlot(ctx, id, rid, networkOf(c.Bundle), false)
}

// Checkpoint writes the sandbox's memory image to dir/checkpoint.img and
// leaves the sandbox stopped; with leaveRunning it is then restored in
// place from that image (restoreSwap: into its other slot, the old one
// deleted in the background) and put back in the state it had, running
// or paused. (runsc's own --leave-running never returns in this version.)
//
// A paused sandbox is thawed right before the checkpoint: runsc
// checkpoints a paused sandbox but then cannot stop it ("invalid state
// transition"), and the sandbox hangs half-saved. The checkpoint freezes
// the sandbox itself and flushes gVisor's file caches to the gofer, so the
// disk, while the sandbox stays stopped, matches the image.
//
// A sandbox whose cgroup has no room left for the save (saveFits) is
// refused with FailedPrecondition before runsc is called, and runs on.
func (d *Driver) Checkpoint(ctx context.Context, id, dir string, leaveRunning bool) error {
	begin := time.Now()
	if err := d.memoryOff("checkpoint", id); err != nil {
		return err
	}
	if !filepath.IsAbs(dir) {
		return fmt.Errorf("gvisor checkpoint %s: dir %q is not absolute: %w", id, dir, errdefs.ErrInvalidArgument)
	}
	c, rid, _, err := d.lookup(ctx, id)
	if err != nil {
		return err
	}
	if c.Status != "running" && c.Status != "paused" {
		return fmt.Errorf("gvisor checkpoint %s: sandbox is %s: %w", id, c.Status, errdefs.ErrFailedPrecondition)
	}
	if err := d.saveFits(id, c.Bundle); err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("gvisor checkpoint %s: %w", id, err)
	}
	if leaveRunning {
		// The restore goes into the other slot: wait for the sandbox
		// last retired from it now, while a timeout leaves this one
		// running untouched.
		if err := d.awaitExit(ctx, otherSlot(id, rid)); err != nil {
			return fmt.Errorf("gvisor checkpoint %s: %w", id, err)
		}
	}
	network := networkOf(c.Bundle)
	paused := c.Status == "paused"
	if paused {
		if err := d.pauseSlot(ctx, id, rid, network, false); err != nil {
			return fmt.Errorf("resume before checkpoint: %w", err)
		}
	}
	logFile := filepath.Join(c.Bundle, "runsc.log")
	if err := d.runCheckpoint(ctx, id, rid, dir, network, logFile); err != nil {
		if paused {
			_ = d.pauseSlot(context.WithoutCancel(ctx), id, rid, network, true)
		}
		return err
	}
	d.log.DebugContext(ctx, "checkpointed", "id", id, "dir", dir, "took", time.Since(begin))
	if !leaveRunning {
		return d.stopCheckpointed(ctx, id, rid, c.Bundle)
	}
	if _, err := d.restoreSwap(ctx, id, c.Bundle, rid, dir); err != nil {
		return err
	}
	if paused {
		return d.Pause(ctx, id)
	}
	return nil
}

// stopCheckpointed finishes the stop a checkpoint began, without waiting:
// `runsc checkpoint` returns once the image is written, and the sandbox
// process then takes up to a second to exit by itself. Nothing of it is
// needed any more, so every process in its cgroup gets SIGKILL, and runsc's
// state file is rewritten to say stopped with no PIDs, so State says
// stopped at once and no later runsc call signals the PIDs, which are
// soon reused. Stop waits for the processes to leave the cgroup.
func (d *Driver) stopCheckpointed(ctx context.Context, id, rid, bundle string) error {
	if sp, err := readSpec(bundle); err == nil && sp.Linux != nil && sp.Linux.CgroupsPath != "" {
		d.keepDying(rid, killPidfds(sp.Linux.CgroupsPath))
	}
	if err := d.editState(rid, func(st, _ map[string]json.RawMessage) {
		st["status"] = json.RawMessage(`"stopped"`)
	}); err != nil {
		return fmt.Errorf("gvisor checkpoint %s: %w", id, err)
	}
	return nil
}

// connRetries bounds how often Checkpoint retries while a TCP connection
// through the sandbox's network device is still closing.
const connRetries = 10

// checkpoint runs runsc checkpoint. This runsc cannot save a TCP
// connection that runs over a host network device (the slot's veth), and
// fails without touching the sandbox; a connection the client just closed
// is gone a few milliseconds later, so the failure is retried briefly
// before it is reported as FailedPrecondition.
func (d *Driver) runCheckpoint(ctx context.Context, id, rid, dir, network, logFile string) error {
	for attempt := 0; ; attempt++ {
		// runsc creates the image with O_EXCL and leaves it behind when
		// it fails: a retry, or a new attempt on the same directory,
		// would die on "file exists" before it reached the sandbox.
		if err := os.Remove(filepath.Join(dir, CheckpointFile)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("gvisor checkpoint %s: remove stale image: %w", id, err)
		}
		err := d.rsc(network, logFile).Checkpoint(ctx, rid, &gorunc.CheckpointOpts{ImagePath: dir})
		if err == nil {
			return nil
		}
		msg := err.Error() + tail(logFile, 4096)
		if !strings.Contains(msg, "cannot be saved in connected state") {
			err = d.classify(ctx, "checkpoint", id, err, tail(logFile, 512))
			if c, serr := d.container(context.WithoutCancel(ctx), id); serr == nil && c.Status == "stopped" {
				// runsc stops the sandbox before it finds it cannot
				// save it; the caller must know it is gone.
				err = fmt.Errorf("%w (runsc stopped the sandbox)", err)
			}
			return err
		}
		if attempt == connRetries {
			return fmt.Errorf("gvisor checkpoint %s: the sandbox holds open TCP connections over its network device, which this runsc cannot save: %w",
				id, errdefs.ErrFailedPrecondition)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("gvisor checkpoint %s: %w", id, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// RestoreInPlace replaces the (stopped) sandbox id by one restored from
// the memory image in dir, reusing its bundle, so the sandbox ID, spec,
// root filesystem, cgroup and network namespace stay the same. The
// restored copy runs in the sandbox's other runsc slot and the old one is
// deleted in the background (restoreSwap, slots.go); a still running id
// is killed first. The bundle's config.json is reused as written.
func (d *Driver) RestoreInPlace(ctx context.Context, id, dir string) (runtime.State, error) {
	if err := d.memoryOff("restore", id); err != nil {
		return runtime.State{}, err
	}
	c, rid, _, err := d.lookup(ctx, id)
	if err != nil {
		return runtime.State{}, err
	}
	return d.restoreSwap(ctx, id, c.Bundle, rid, dir)
}

// RestoreBundle restores id from the image in dir with the spec its
// bundle holds, whether or not runsc still knows id (a sandbox runsc
// knows is swapped out as by RestoreInPlace). It is how a restore in
// place cut short after the removal is finished: the bundle outlives
// runsc's state.
func (d *Driver) RestoreBundle(ctx context.Context, id, bundle, dir string) (runtime.State, error) {
	if err := d.memoryOff("restore", id); err != nil {
		return runtime.State{}, err
	}
	c, rid, _, err := d.lookup(ctx, id)
	if err == nil {
		return d.restoreSwap(ctx, id, c.Bundle, rid, dir)
	}
	if !errdefs.IsNotFound(err) {
		return runtime.State{}, err
	}
	spec, err := readSpec(bundle)
	if err != nil {
		return runtime.State{}, fmt.Errorf("gvisor restore %s in place: %w", id, err)
	}
	if _, err := os.Stat(filepath.Join(dir, CheckpointFile)); err != nil {
		return runtime.State{}, fmt.Errorf("gvisor restore %s: no memory image in %s: %w", id, dir, errdefs.ErrNotFound)
	}
	// No state file left, but a background reap of either slot may still
	// be deleting it.
	for _, rid := range slotIDs(id) {
		if err := d.awaitReap(ctx, rid); err != nil {
			return runtime.State{}, err
		}
	}
	if err := restoreNet(spec, bundle); err != nil {
		return runtime.State{}, fmt.Errorf("gvisor restore %s in place: %w", id, err)
	}
	if err := failpoint.Eval(ctx, FailpointRestoreStopped); err != nil {
		return runtime.State{}, err
	}
	return d.launchAs(ctx, id, slotIDs(id)[0], bundle, spec, dir)
}

// FailpointRestoreStopped fires inside a restore in place between the
// retirement of the stopped sandbox and the launch from the image.
const FailpointRestoreStopped = "gvisor/restore/stopped"

// Stop kills every process of the sandbox (sandbox, gofer and the
// container's processes) and removes runsc's state and the cgroup.
// Stopping an absent sandbox is a no-op.
func (d *Driver) Stop(ctx context.Context, id string) error {
	begin := time.Now()
	// A background reap of either slot may be in flight whatever lookup
	// finds (its state file can be gone before runsc's delete returns):
	// Stop returns only once it has ended, so a Start that follows does
	// not launch into a slot still being deleted.
	for _, rid := range slotIDs(id) {
		if err := d.awaitReap(ctx, rid); err != nil {
			return err
		}
	}
	c, rid, retired, err := d.lookup(ctx, id)
	if errdefs.IsNotFound(err) {
		d.dropDying(id)
		return nil
	}
	if err != nil {
		return err
	}
	network := networkOf(c.Bundle)
	// runsc delete --force panics on a paused sandbox ("invalid state
	// transition: paused => stopped") after killing it half-way; thaw
	// first so delete takes its normal path.
	if c.Status == "paused" {
		if err := d.pauseSlot(ctx, id, rid, network, false); err != nil {
			d.log.WarnContext(ctx, "resume before stop", "id", id, "error", err)
		}
	}
	sp, err := readSpec(c.Bundle)
	if err != nil {
		// No spec: nothing to give back, and runsc still deletes.
		sp = &specs.Spec{}
	}
	if err := d.destroy(ctx, id, rid, c.Bundle, sp); err != nil {
		return err
	}
	if retired != "" {
		if err := d.reap(ctx, id, retired); err != nil {
			return err
		}
	}
	// The slot neither delete touched may hold a lock file a racing runsc
	// verb left (dropStaleLock).
	if err := d.dropStaleLock(ctx, otherSlot(id, rid)); err != nil {
		return fmt.Errorf("gvisor stop %s: %w", id, err)
	}
	d.dropDying(id)
	d.log.DebugContext(ctx, "stopped", "id", id, "took", time.Since(begin))
	return nil
}

// destroy force-deletes slot rid of sandbox id (every process in its
// cgroup killed first), gives the network namespace its addresses back and
// removes the cgroup everywhere.
func (d *Driver) destroy(ctx context.Context, id, rid, bundle string, sp *specs.Spec) error {
	// Every process in the sandbox's cgroup dies first. runsc's delete
	// kills only the processes its state file names, and then waits for
	// the cgroup to empty: a sandbox or gofer it never recorded (a runsc
	// cut off mid-start) kept the cgroup busy and the delete failed,
	// leaving them running. Force-delete kills the sandbox anyway.
	if sp.Linux != nil && sp.Linux.CgroupsPath != "" {
		if n, err := cgroups.Kill(sp.Linux.CgroupsPath, cgroupRemoveTimeout); err != nil {
			return fmt.Errorf("gvisor stop %s: %w", id, err)
		} else if n > 0 {
			d.log.DebugContext(ctx, "killed the cgroup's processes", "id", id, "processes", n)
		}
		// Every process of the sandbox is dead now, so runsc must signal
		// none by the PIDs its state recorded: it SIGKILLs them without
		// checking, and a PID freed (a checkpoint stopped the sandbox, or
		// the kill above) is soon another process's. On a host whose PIDs
		// wrap within seconds that killed other sandboxes.
		if err := d.editState(rid, nil); err != nil {
			return fmt.Errorf("gvisor stop %s: %w", id, err)
		}
	}
	if err := d.rsc(networkFor(sp), "").Delete(ctx, rid, &gorunc.DeleteOpts{Force: true}); err != nil {
		if err := d.classify(ctx, "delete", id, err, ""); !errdefs.IsNotFound(err) {
			return err
		}
	}
	if err := d.dropStaleLock(ctx, rid); err != nil {
		return fmt.Errorf("gvisor stop %s: %w", id, err)
	}
	if err := restoreNet(sp, bundle); err != nil {
		return fmt.Errorf("gvisor stop %s: %w", id, err)
	}
	if sp.Linux == nil || sp.Linux.CgroupsPath == "" {
		return nil
	}
	if _, err := cgroups.Remove(sp.Linux.CgroupsPath, cgroupRemoveTimeout); err != nil {
		return fmt.Errorf("gvisor stop %s: %w", id, err)
	}
	return nil
}

// State implements runtime.Driver.
func (d *Driver) State(ctx context.Context, id string) (runtime.State, error) {
	c, err := d.container(ctx, id)
	if err != nil {
		return runtime.State{}, err
	}
	return toState(c), nil
}

func (d *Driver) container(ctx context.Context, id string) (*gorunc.Container, error) {
	c, _, _, err := d.lookup(ctx, id)
	return c, err
}

// runscID is the runsc container ID of sandbox id's slot A, where every
// sandbox starts (slots.go). This runsc resolves IDs by prefix and refuses
// one that is the prefix of another ("sb-1" while "sb-10" exists is
// "ambiguous"); the terminator, which sandbox IDs never contain, makes no
// runsc ID a prefix of another.
func runscID(id string) string { return slotIDs(id)[0] }

// List implements runtime.Driver. It reads runsc's state files (so it
// also sees sandboxes other processes started in its root), never `runsc
// list`: that loads every container, and one it loads while a retired
// slot is being deleted gets its lock file created again after the
// delete (dropStaleLock).
func (d *Driver) List(ctx context.Context) ([]runtime.State, error) {
	all, err := d.slotsInRoot()
	if err != nil {
		return nil, fmt.Errorf("gvisor list: %w", err)
	}
	out := make([]runtime.State, 0, len(all))
	for id := range all {
		// A sandbox with a retired slot next to its current one is
		// listed once, as its current slot says.
		c, _, _, err := d.lookup(ctx, id)
		if errdefs.IsNotFound(err) {
			continue // deleted since the directory was read
		}
		if err != nil {
			// One unreadable state must not hide every other sandbox;
			// left out, it is neither adopted nor swept as an orphan.
			d.log.WarnContext(ctx, "list: sandbox state unreadable; left out", "id", id, "error", err)
			continue
		}
		out = append(out, toState(c))
	}
	slices.SortFunc(out, func(a, b runtime.State) int { return strings.Compare(a.ID, b.ID) })
	return out, nil
}

func toState(c *gorunc.Container) runtime.State {
	st := runtime.State{ID: c.ID, PID: c.Pid, Created: c.Created}
	switch c.Status {
	case "running":
		st.Status = runtime.StatusRunning
	case "paused":
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

// classify maps a runsc failure onto errdefs by its message (runsc exits
// 128 for every failure).
func (d *Driver) classify(ctx context.Context, verb, id string, err error, detail string) error {
	msg := err.Error()
	if detail != "" {
		msg += ": " + detail
	}
	if cerr := ctx.Err(); cerr != nil {
		return fmt.Errorf("gvisor %s %s: %w: %s", verb, id, cerr, msg)
	}
	if errors.Is(err, errdefs.ErrUnavailable) {
		return err
	}
	var kind error
	switch {
	case strings.Contains(msg, "file does not exist"), strings.Contains(msg, "does not exist"):
		kind = errdefs.ErrNotFound
	case strings.Contains(msg, "already exists"):
		kind = errdefs.ErrAlreadyExists
	case strings.Contains(msg, "not running"), strings.Contains(msg, "not paused"),
		strings.Contains(msg, "invalid state"), strings.Contains(msg, "is stopped"),
		strings.Contains(msg, "cannot pause"), strings.Contains(msg, "cannot resume"):
		kind = errdefs.ErrFailedPrecondition
	default:
		kind = errdefs.ErrInternal
	}
	return fmt.Errorf("gvisor %s %s: %w: %s", verb, id, kind, strings.TrimSpace(msg))
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

func readSpec(bundle string) (*specs.Spec, error) {
	b, err := os.ReadFile(filepath.Join(bundle, "config.json"))
	if err != nil {
		return nil, err
	}
	var sp specs.Spec
	if err := json.Unmarshal(b, &sp); err != nil {
		return nil, fmt.Errorf("bundle %s: %w", bundle, err)
	}
	return &sp, nil
}

// networkOf is the --network mode of the sandbox whose bundle is bundle.
func networkOf(bundle string) string {
	sp, err := readSpec(bundle)
	if err != nil {
		return "none"
	}
	return networkFor(sp)
}

func networkFor(sp *specs.Spec) string {
	if sp.Linux != nil {
		for _, ns := range sp.Linux.Namespaces {
			if ns.Type == specs.NetworkNamespace && ns.Path != "" {
				return "sandbox"
			}
		}
	}
	return "none"
}

// tail returns at most n bytes from the end of a file, for error messages.
func tail(path string, n int64) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	if st, err := f.Stat(); err == nil && st.Size() > n {
		_, _ = f.Seek(st.Size()-n, io.SeekStart)
	}
	b, _ := io.ReadAll(f)
	return strings.TrimSpace(string(b))
}

var _ runtime.Prober = (*Driver)(nil)
var _ runtime.BundleRestorer = (*Driver)(nil)

// Probe checks runsc's binary and root without running runsc.
func (d *Driver) Probe(context.Context) error { return runtime.ProbeFiles(d.root, d.bin) }
