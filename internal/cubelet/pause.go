package cubelet

import (
	"context"
	"fmt"
	"os"

	"github.com/cubesandbox/cube/internal/cubelet/actions"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// Pause and resume in either pause mode (memory: the runtime freezes the
// sandbox; disk: its memory image is written and the runtime's sandbox
// stopped). The flows are pause/resume and pause_disk/resume_disk; their
// actions are in package actions (diskpause.go draws the state machine).

// Pause freezes a running sandbox, its memory resident (PauseTo also
// pauses to disk).
func (s *Service) Pause(ctx context.Context, id string) (*Result, error) {
	return s.PauseTo(ctx, id, sandbox.PauseMemory)
}

// Resume thaws a paused sandbox, or restores a disk-paused one from its
// memory image, and returns once its agent answers.
func (s *Service) Resume(ctx context.Context, id string) (*Result, error) {
	return s.pauseModeVerb(ctx, id, FlowResume, lifecycle.Running, "")
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
		return nil, errdefs.FieldErrorf("mode", "unknown pause mode %q (memory or disk)", mode)
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
		if err := s.node.CheckDiskPausable(rec); err != nil {
			return nil, err
		}
	}
	if flow == FlowPauseDisk || flow == FlowResumeDisk {
		if tmpl, err = s.store.GetTemplate(rec.TemplateID); err != nil {
			return nil, fmt.Errorf("template of %s: %w", id, err)
		}
	}
	t := newTask(s.store, e, rec, tmpl)
	t.DiskPause = &actions.DiskPauseRun{Image: s.node.PausedImageDir(rec.HostKey())}
	fctx, cancel := detached(ctx)
	defer cancel()
	res, err := s.engine.Run(fctx, flow, t)
	if err != nil {
		return &Result{Sandbox: t.Record(), Timings: res.Timings, Flow: flow}, err
	}
	update := t.Update
	if flow == FlowPause || flow == FlowResume {
		// A memory pause or resume is the runtime's own state (the
		// cgroup freezer, a stopped VM): a cubelet killed before this
		// record reaches the disk reads it back at restart (reconcile
		// adopts Running or Paused as the runtime reports it), so the
		// caller does not wait for the fsync.
		update = t.UpdateLazy
	}
	if err := update(func(r *sandbox.Record) { r.State, r.PauseMode = to, mode }); err != nil {
		return nil, err
	}
	if flow == FlowResumeDisk {
		// Only now: until the record says Running, the image is what a
		// retried resume (or a restarted cubelet) restores from.
		if err := os.RemoveAll(t.DiskPause.Image); err != nil {
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
func (s *Service) adoptDiskPaused(ctx context.Context, t *actions.Task, sum *reconcileSummary) {
	rec := t.Record()
	if _, err := os.Stat(s.node.PausedImageDir(rec.HostKey())); err != nil {
		_ = t.Update(func(r *sandbox.Record) {
			r.State, r.Error = lifecycle.Failed, "memory image of disk-paused sandbox lost: "+err.Error()
		})
		s.release(ctx, t, sum)
		sum.Failed++
		return
	}
	// A runtime sandbox left under its ID (a resume cut short) is not the
	// disk-paused one: stop it; the image restores it again.
	if d, err := s.node.Driver(rec.Runtime); err == nil && rec.Container != nil {
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
	dir := s.node.PausedImageDir(rec.HostKey())
	if _, err := os.Stat(dir); err == nil {
		if err := os.RemoveAll(dir); err != nil {
			s.log.Warn("remove stale memory image", "sandbox_id", rec.ID, "err", err)
		}
	}
}
