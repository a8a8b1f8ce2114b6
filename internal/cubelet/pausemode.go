package cubelet

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/workflow"
)

// Pause modes. A sandbox is paused one of two ways (sandbox.PauseMode):
//
//	           pause (memory): runtime freeze        resume: thaw, agent
//	Running ───────────────────────────────► Paused ─────────────────────► Running
//	   │                                      ▲
//	   │  pause_disk: [checkpoint] [evict]    │ resume_disk: [net] [restore]
//	   └──────────────────────────────────────┘
//	          quiesce agent, write the memory      restore from the image (same
//	          image, stop the runtime (memory      ID, disk, slot), wake the
//	          freed; Container kept as the         agent, wait for /health;
//	          recipe for the restore)              then the image is removed
//
// The image lives in the sandbox's pool directory (pausedImageDir), so
// destroy (disk action) and the orphan sweep remove it with the disk; a
// resumed sandbox's leftover image (cubelet died right after the resume)
// is removed by reconcile (sweepPausedImage).

// Flows of the pause modes.
const (
	FlowPauseDisk  = "pause_disk"
	FlowResumeDisk = "resume_disk"
)

// The capabilities of the disk pause verbs.
type (
	// DiskPauser does its part of writing a running sandbox's memory to
	// disk and freeing it.
	DiskPauser interface {
		PauseToDisk(ctx context.Context, t *Task) error
		// UndoPauseToDisk brings the sandbox back running, as it was; it
		// must be idempotent and harmless when PauseToDisk never ran.
		UndoPauseToDisk(ctx context.Context, t *Task) error
	}
	// DiskResumer does its part of restoring a disk-paused sandbox.
	DiskResumer interface {
		ResumeFromDisk(ctx context.Context, t *Task) error
		// UndoResumeFromDisk leaves the sandbox disk-paused again, its
		// image untouched.
		UndoResumeFromDisk(ctx context.Context, t *Task) error
	}
)

// pauseOp is the typed state of one pause_disk or resume_disk run.
type pauseOp struct {
	// image is the memory image directory.
	image string
	// quiesced: the agent was quieted and nothing has woken it yet.
	quiesced bool
}

// pausedImageName is the memory image's directory inside the sandbox's
// pool directory.
const pausedImageName = "paused-memory"

func (n *node) pausedImageDir(id string) string {
	return filepath.Join(n.pool.SandboxDir(id), pausedImageName)
}

func pauseModeVerbs() []workflow.Verb[*Task] {
	return []workflow.Verb[*Task]{
		{
			Name:     FlowPauseDisk,
			Mode:     workflow.Forward,
			Supports: workflow.Implements[DiskPauser],
			Call: func(ctx context.Context, a workflow.Action, t *Task) error {
				return a.(DiskPauser).PauseToDisk(ctx, t)
			},
			Undo: func(ctx context.Context, a workflow.Action, t *Task) error {
				return a.(DiskPauser).UndoPauseToDisk(ctx, t)
			},
		},
		{
			Name: FlowResumeDisk,
			Mode: workflow.Forward,
			// "net" re-applies the policy (Resumer) before the restore.
			Supports: func(a workflow.Action) bool {
				return workflow.Implements[DiskResumer](a) || workflow.Implements[Resumer](a)
			},
			Call: func(ctx context.Context, a workflow.Action, t *Task) error {
				if r, ok := a.(DiskResumer); ok {
					return r.ResumeFromDisk(ctx, t)
				}
				return a.(Resumer).Resume(ctx, t)
			},
			// A policy re-applied to a sandbox that stays paused is harmless.
			Undo: func(ctx context.Context, a workflow.Action, t *Task) error {
				if r, ok := a.(DiskResumer); ok {
					return r.UndoResumeFromDisk(ctx, t)
				}
				return nil
			},
		},
	}
}

// registerPauseModeActions adds the actions only the disk pause verbs use.
func registerPauseModeActions(n *node, reg *workflow.Registry) {
	reg.MustRegister(&checkpointAction{n: n}, &evictAction{n: n}, &restoreAction{n: n})
}

var (
	_ DiskPauser  = (*checkpointAction)(nil)
	_ DiskPauser  = (*evictAction)(nil)
	_ DiskResumer = (*restoreAction)(nil)
)

func pop(t *Task) (*pauseOp, error) {
	if t.pause == nil {
		return nil, fmt.Errorf("pause mode verb without its state: %w", errdefs.ErrInternal)
	}
	return t.pause, nil
}

// checkDiskPausable refuses pause-to-disk on runtimes that cannot write a
// memory image and restore it (runc; gvisor with checkpoint = false).
func (n *node) checkDiskPausable(rec *sandbox.Record) error {
	d, err := n.driver(rec.Runtime)
	if err != nil {
		return err
	}
	if c := d.Capabilities(); !c.Checkpoint || !c.Restore {
		return fmt.Errorf("pause %s to disk: runtime %s cannot checkpoint and restore memory (pause it in memory instead): %w",
			rec.ID, rec.Runtime, errdefs.ErrFailedPrecondition)
	}
	if rec.Container == nil {
		return fmt.Errorf("pause %s to disk: no container: %w", rec.ID, errdefs.ErrFailedPrecondition)
	}
	return nil
}

// checkpointAction quiesces the agent (where the runtime needs it) and
// writes the memory image; the runtime's sandbox stops doing so.
type checkpointAction struct{ n *node }

func (*checkpointAction) Name() string { return "checkpoint" }

func (a *checkpointAction) PauseToDisk(ctx context.Context, t *Task) error {
	o, err := pop(t)
	if err != nil {
		return err
	}
	rec := t.Record()
	d, err := a.n.driver(rec.Runtime)
	if err != nil {
		return err
	}
	// A stale image (an earlier attempt) must not mix with this one.
	if err := os.RemoveAll(o.image); err != nil {
		return err
	}
	if _, ok := a.n.needsQuiesce(rec); ok {
		// Set first: a quiesce that fails after the agent acted must
		// still be woken by the undo.
		o.quiesced = true
		if err := a.n.quiesceAgent(ctx, rec); err != nil {
			if errdefs.IsFailedPrecondition(err) {
				o.quiesced = false // 409: the agent changed nothing
			}
			return err
		}
	}
	if err := d.Checkpoint(ctx, rec.Container.ID, o.image, false); err != nil {
		return err
	}
	// The image is complete: from here a crash must leave the sandbox
	// disk-paused, not dead (reconcile adopts it from the image).
	return t.Update(func(r *sandbox.Record) { r.PauseMode = sandbox.PauseDisk })
}

// UndoPauseToDisk brings the sandbox back running: a live one only needs
// its agent woken; one the checkpoint stopped (or evict removed) is
// restored from the image just written. The image goes either way.
func (a *checkpointAction) UndoPauseToDisk(ctx context.Context, t *Task) error {
	o, err := pop(t)
	if err != nil {
		return err
	}
	rec := t.Record()
	d, err := a.n.driver(rec.Runtime)
	if err != nil {
		return err
	}
	st, err := d.State(ctx, rec.Container.ID)
	switch {
	case err == nil && (st.Status == runtime.StatusRunning || st.Status == runtime.StatusPaused):
		if o.quiesced {
			if err := a.n.wakeAgent(ctx, rec); err != nil {
				return err
			}
			o.quiesced = false
		}
	case err == nil || errdefs.IsNotFound(err):
		if err := a.n.restoreFromImage(ctx, t, d, o); err != nil {
			return fmt.Errorf("bring %s back from its memory image: %w", rec.ID, err)
		}
	default:
		return err
	}
	if err := t.Update(func(r *sandbox.Record) { r.PauseMode = "" }); err != nil {
		return err
	}
	return os.RemoveAll(o.image)
}

// evictAction stops the checkpointed sandbox in its runtime: every
// process goes and its memory is freed. The record keeps Container, the
// recipe for the restore.
type evictAction struct{ n *node }

func (*evictAction) Name() string { return "evict" }

func (a *evictAction) PauseToDisk(ctx context.Context, t *Task) error {
	rec := t.Record()
	d, err := a.n.driver(rec.Runtime)
	if err != nil {
		return err
	}
	if err := d.Stop(ctx, rec.Container.ID); err != nil {
		return err
	}
	return t.Update(func(r *sandbox.Record) { r.Container.PID = 0 })
}

// UndoPauseToDisk leaves the restore to the checkpoint action's undo,
// which runs next and handles a stopped and an absent sandbox alike.
func (*evictAction) UndoPauseToDisk(context.Context, *Task) error { return nil }

// restoreAction starts the disk-paused sandbox again from its image, wakes
// its agent and waits for it.
type restoreAction struct{ n *node }

func (*restoreAction) Name() string { return "restore" }

func (a *restoreAction) ResumeFromDisk(ctx context.Context, t *Task) error {
	o, err := pop(t)
	if err != nil {
		return err
	}
	rec := t.Record()
	d, err := a.n.driver(rec.Runtime)
	if err != nil {
		return err
	}
	if _, err := os.Stat(o.image); err != nil {
		return fmt.Errorf("resume %s from disk: memory image: %w: %w", rec.ID, err, errdefs.ErrNotFound)
	}
	return a.n.restoreFromImage(ctx, t, d, o)
}

// UndoResumeFromDisk stops what the restore started: the sandbox is
// disk-paused again and its image, which a restore does not change, can
// be restored once more.
func (a *restoreAction) UndoResumeFromDisk(ctx context.Context, t *Task) error {
	rec := t.Record()
	d, err := a.n.driver(rec.Runtime)
	if err != nil {
		return err
	}
	if err := d.Stop(ctx, rec.Container.ID); err != nil {
		return err
	}
	return t.Update(func(r *sandbox.Record) { r.Container.PID = 0 })
}

// restoreFromImage replaces whatever is left of the sandbox in its
// runtime (a stopped checkpointed sandbox, or nothing) by one restored
// from the image, under the same ID, bundle, disk and network slot, and
// waits until its woken agent answers. A failure stops what it started.
func (n *node) restoreFromImage(ctx context.Context, t *Task, d runtime.Driver, o *pauseOp) error {
	rec := t.Record()
	if err := d.Stop(ctx, rec.Container.ID); err != nil {
		return err
	}
	spec, err := n.launchSpec(rec, t.Template)
	if err != nil {
		return err
	}
	st, err := d.Restore(ctx, spec, o.image)
	if err != nil {
		return err
	}
	if err := t.Update(func(r *sandbox.Record) { r.Container.PID = st.PID }); err != nil {
		return errors.Join(err, d.Stop(context.WithoutCancel(ctx), rec.Container.ID))
	}
	// The image holds a quiesced agent (where the runtime needs one):
	// wake it; wakeAgent only waits for /health otherwise.
	if err := n.wakeAgent(ctx, t.Record()); err != nil {
		stopErr := d.Stop(context.WithoutCancel(ctx), rec.Container.ID)
		_ = t.Update(func(r *sandbox.Record) { r.Container.PID = 0 })
		return errors.Join(err, stopErr)
	}
	o.quiesced = false
	return nil
}

// launchSpec is the runtime spec containerAction.Create starts the
// sandbox with, rebuilt from the record and template.
func (n *node) launchSpec(rec *sandbox.Record, tmpl *sandbox.Template) (runtime.Spec, error) {
	if tmpl == nil {
		return runtime.Spec{}, fmt.Errorf("sandbox %s: no template to build its spec: %w", rec.ID, errdefs.ErrInternal)
	}
	d, err := n.driver(rec.Runtime)
	if err != nil {
		return runtime.Spec{}, err
	}
	spec := (&containerAction{n: n}).spec(rec, rec.Container, tmpl)
	if spec.Mounts, err = n.hostMountsFor(rec.HostMounts); err != nil {
		return runtime.Spec{}, err
	}
	if m, ok := n.sharedAgent(); ok && !d.Capabilities().BootsDisk {
		spec.Mounts = append(spec.Mounts, m)
	}
	return spec, nil
}

// PauseTo pauses a running sandbox in the given mode (memory when empty).
// A pause to disk that fails leaves the sandbox running as it was.
func (s *Service) PauseTo(ctx context.Context, id string, mode sandbox.PauseMode) (*Result, error) {
	switch mode {
	case "", sandbox.PauseMemory:
		return s.pauseModeVerb(ctx, id, FlowPause, lifecycle.Paused, sandbox.PauseMemory)
	case sandbox.PauseDisk:
		return s.pauseModeVerb(ctx, id, FlowPauseDisk, lifecycle.Paused, sandbox.PauseDisk)
	default:
		return nil, fieldErr("mode", "unknown pause mode %q (memory or disk)", mode)
	}
}

// pauseModeVerb runs a pause or resume flow under the sandbox's lock and
// records the new state and pause mode together. Resume picks its flow
// from the record's pause mode.
func (s *Service) pauseModeVerb(ctx context.Context, id, flow string, to lifecycle.State, mode sandbox.PauseMode) (*Result, error) {
	e, err := s.lockFor(ctx, id, to, flow)
	if err != nil {
		return nil, err
	}
	defer e.release()
	rec := e.rec.Load()
	var tmpl *sandbox.Template
	if to == lifecycle.Running && rec.PauseMode == sandbox.PauseDisk {
		flow = FlowResumeDisk
	}
	if flow == FlowPauseDisk {
		if err := s.node.checkDiskPausable(rec); err != nil {
			return nil, err
		}
	}
	if flow == FlowPauseDisk || flow == FlowResumeDisk {
		if tmpl, err = s.store.GetTemplate(rec.TemplateID); err != nil {
			return nil, fmt.Errorf("template of %s: %w", id, err)
		}
	}
	t := newTask(s.store, e, rec, tmpl)
	t.pause = &pauseOp{image: s.node.pausedImageDir(id)}
	res, err := s.engine.Run(ctx, flow, t)
	if err != nil {
		return &Result{Sandbox: t.Record(), Timings: res.Timings, Flow: flow}, err
	}
	if err := t.Update(func(r *sandbox.Record) { r.State, r.PauseMode = to, mode }); err != nil {
		return nil, err
	}
	if flow == FlowResumeDisk {
		// Only now: until the record says Running, the image is what a
		// retried resume (or a restarted cubelet) restores from.
		if err := os.RemoveAll(t.pause.image); err != nil {
			s.log.Warn("remove memory image of resumed sandbox", "sandbox_id", id, "err", err)
		}
	}
	s.log.Info("sandbox "+string(to), "sandbox_id", id, "flow", flow, "duration", res.Duration)
	return &Result{Sandbox: t.Record(), Timings: res.Timings, Flow: flow}, nil
}

// refuseDiskPaused is the guard of verbs that need the sandbox's runtime
// container (snapshot, rollback): a disk-paused sandbox has none.
func refuseDiskPaused(rec *sandbox.Record, verb string) error {
	if rec.State == lifecycle.Paused && rec.PauseMode == sandbox.PauseDisk {
		return fmt.Errorf("%s %s: sandbox is paused to disk; resume it first: %w", verb, rec.ID, errdefs.ErrFailedPrecondition)
	}
	return nil
}

// adoptDiskPaused is restart reconcile for a disk-paused sandbox: it has
// no runtime container by design, so it stays Paused while its image is
// there, and is Failed (and released) when the image is gone.
func (s *Service) adoptDiskPaused(ctx context.Context, t *Task, sum *reconcileSummary) {
	rec := t.Record()
	if _, err := os.Stat(s.node.pausedImageDir(rec.ID)); err != nil {
		_ = t.Update(func(r *sandbox.Record) {
			r.State, r.Error = lifecycle.Failed, "memory image of disk-paused sandbox lost: "+err.Error()
		})
		s.release(ctx, t, sum)
		sum.Failed++
		return
	}
	// A runtime sandbox left under its ID (a resume cut short) is not the
	// disk-paused one: stop it; the image restores it again.
	if d, err := s.node.driver(rec.Runtime); err == nil && rec.Container != nil {
		if err := d.Stop(ctx, rec.Container.ID); err != nil {
			sum.Errors = append(sum.Errors, fmt.Sprintf("%s: stop leftover container: %v", rec.ID, err))
		}
	}
	_ = t.Update(func(r *sandbox.Record) { r.Error = ""; r.Container.PID = 0 })
	sum.Adopted++
}

// sweepPausedImage removes the memory image of a sandbox that is not
// disk-paused (cubelet died between a resume and the image's removal).
func (s *Service) sweepPausedImage(rec *sandbox.Record) {
	if rec.PauseMode == sandbox.PauseDisk {
		return
	}
	dir := s.node.pausedImageDir(rec.ID)
	if _, err := os.Stat(dir); err == nil {
		if err := os.RemoveAll(dir); err != nil {
			s.log.Warn("remove stale memory image", "sandbox_id", rec.ID, "err", err)
		}
	}
}
