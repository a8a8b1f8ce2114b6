package actions

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cubesandbox/cube/internal/cubelet/agentclient"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// Pause to disk. A sandbox is paused one of two ways (sandbox.PauseMode):
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
// The image lives in the sandbox's pool directory (PausedImageDir), so
// destroy (disk action) and the orphan sweep remove it with the disk; a
// resumed sandbox's leftover image (cubelet died right after the resume)
// is removed by the core's reconcile.

// FailpointCheckpointWritten fires between a pause to disk's checkpoint
// (the image complete, the runtime sandbox stopped) and the record saying
// so.
const FailpointCheckpointWritten = "pause_disk/checkpoint/written"

// pausedImageName is the memory image's directory inside the sandbox's
// pool directory.
const pausedImageName = "paused-memory"

// PausedImageDir is where a disk-paused sandbox's memory image lives.
func (n *Node) PausedImageDir(id string) string {
	return filepath.Join(n.Pool.SandboxDir(id), pausedImageName)
}

// CheckDiskPausable refuses pause-to-disk on runtimes that cannot write a
// memory image and restore it (runc; gvisor with checkpoint = false).
func (n *Node) CheckDiskPausable(rec *sandbox.Record) error {
	d, err := n.Driver(rec.Runtime)
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
type checkpointAction struct{ n *Node }

func (*checkpointAction) Name() string { return "checkpoint" }

func (a *checkpointAction) PauseToDisk(ctx context.Context, t *Task) error {
	run, err := diskPauseRun(t)
	if err != nil {
		return err
	}
	rec := t.Record()
	d, err := a.n.Driver(rec.Runtime)
	if err != nil {
		return err
	}
	// A stale image (an earlier attempt) must not mix with this one.
	if err := os.RemoveAll(run.Image); err != nil {
		return err
	}
	if err := a.n.checkImageRoom(rec, run.Image); err != nil {
		return err
	}
	if _, ok := agentclient.NeedsQuiesce(d, rec); ok {
		// Taken first: a quiesce that fails after the agent acted must
		// still be woken by the undo.
		run.Holds.Take(Quiesced, func(ctx context.Context) error {
			return a.n.wakeAgent(ctx, rec)
		})
		if err := agentclient.Quiesce(ctx, d, rec); err != nil {
			if errdefs.IsFailedPrecondition(err) {
				run.Holds.Drop(Quiesced) // 409: the agent changed nothing
			}
			return err
		}
	}
	if err := d.Checkpoint(ctx, rec.Container.ID, run.Image, false); err != nil {
		return err
	}
	// The image is complete: from here a crash must leave the sandbox
	// disk-paused, not dead (reconcile adopts it from the image, also
	// when the crash comes before this record: the runtime sandbox is
	// stopped and the image there).
	if err := failpoint.Eval(ctx, FailpointCheckpointWritten); err != nil {
		return err
	}
	return t.Update(func(r *sandbox.Record) { r.PauseMode = sandbox.PauseDisk })
}

// UndoPauseToDisk brings the sandbox back running: a live one only needs
// its agent woken; one the checkpoint stopped (or evict removed) is
// restored from the image just written. The image goes either way.
func (a *checkpointAction) UndoPauseToDisk(ctx context.Context, t *Task) error {
	run, err := diskPauseRun(t)
	if err != nil {
		return err
	}
	rec := t.Record()
	d, err := a.n.Driver(rec.Runtime)
	if err != nil {
		return err
	}
	st, err := d.State(ctx, rec.Container.ID)
	switch {
	case err == nil && (st.Status == runtime.StatusRunning || st.Status == runtime.StatusPaused):
		if err := run.Holds.Release(ctx, Quiesced); err != nil {
			return err
		}
	case err == nil || errdefs.IsNotFound(err):
		if err := a.n.restoreFromImage(ctx, t, d, run); err != nil {
			return fmt.Errorf("bring %s back from its memory image: %w", rec.ID, err)
		}
	default:
		return err
	}
	if err := t.Update(func(r *sandbox.Record) { r.PauseMode = "" }); err != nil {
		return err
	}
	return os.RemoveAll(run.Image)
}

// evictAction stops the checkpointed sandbox in its runtime: every
// process goes and its memory is freed. The record keeps Container, the
// recipe for the restore.
type evictAction struct{ n *Node }

func (*evictAction) Name() string { return "evict" }

func (a *evictAction) PauseToDisk(ctx context.Context, t *Task) error {
	rec := t.Record()
	d, err := a.n.Driver(rec.Runtime)
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
type restoreAction struct{ n *Node }

func (*restoreAction) Name() string { return "restore" }

func (a *restoreAction) ResumeFromDisk(ctx context.Context, t *Task) error {
	run, err := diskPauseRun(t)
	if err != nil {
		return err
	}
	rec := t.Record()
	d, err := a.n.Driver(rec.Runtime)
	if err != nil {
		return err
	}
	if _, err := os.Stat(run.Image); err != nil {
		return fmt.Errorf("resume %s from disk: memory image: %w: %w", rec.ID, err, errdefs.ErrNotFound)
	}
	return a.n.restoreFromImage(ctx, t, d, run)
}

// UndoResumeFromDisk stops what the restore started: the sandbox is
// disk-paused again and its image, which a restore does not change, can
// be restored once more.
func (a *restoreAction) UndoResumeFromDisk(ctx context.Context, t *Task) error {
	rec := t.Record()
	d, err := a.n.Driver(rec.Runtime)
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
func (n *Node) restoreFromImage(ctx context.Context, t *Task, d runtime.Driver, run *DiskPauseRun) error {
	rec := t.Record()
	if err := d.Stop(ctx, rec.Container.ID); err != nil {
		return err
	}
	spec, unstage, err := n.launchSpec(ctx, rec, t.Template)
	if err != nil {
		return err
	}
	st, err := d.Restore(ctx, spec, run.Image)
	unstage()
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
	run.Holds.Drop(Quiesced)
	return nil
}
