package cubelet

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet/actions"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/hostbind"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/loopdev"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/storage"
)

// reconcileSummary is what a start-up reconcile did, logged as one line.
type reconcileSummary struct {
	Adopted, Failed, Unknown, Finished                  int
	OrphanContainers, OrphanMounts, OrphanLoops, Orphan int
	Errors                                              []string
}

// reconcile compares the store with what really exists on the node and
// makes them agree:
//   - Creating: the create never finished (cubelet died): undo it; a warm
//     pool claim whose record was written is finished instead.
//   - Destroying: finish the destroy.
//   - Running/Paused/Unknown: ask the runtime; adopt what is alive in the
//     state the runtime reports, mark what died Failed and release what it
//     held (the record stays so the user can see why).
//   - Anything on the node that no record names (containers, mounts, loop
//     devices, disk and bundle directories, template files) is an orphan
//     of a crash and is removed.
func (s *Service) reconcile(ctx context.Context) error {
	recs, err := s.store.ListSandboxes()
	if err != nil {
		return err
	}
	var sum reconcileSummary
	// First what runtimes left to delete in the background (gVisor's
	// retired slots): a restore in place the crash cut short then finds
	// the sandbox as the runtime holds it now.
	for name, d := range s.node.Drivers {
		if r, ok := d.(runtime.Reaper); ok {
			if err := r.ReapRetired(ctx); err != nil {
				sum.Errors = append(sum.Errors, fmt.Sprintf("reap %s: %v", name, err))
			}
		}
	}
	known := map[string]bool{}
	for _, rec := range recs {
		known[rec.ID] = true
		known[rec.HostKey()] = true // a sandbox claimed from a warm pool holds its entry's
		e := newEntry(rec)
		e.onPublish = s.watchRecord
		s.boxes[rec.ID] = e
	}
	for _, rec := range recs {
		s.reconcileOne(ctx, rec, &sum)
	}
	s.sweepOrphans(ctx, known, &sum)
	s.log.Info("reconcile done",
		"adopted", sum.Adopted, "failed", sum.Failed, "unknown", sum.Unknown, "finished", sum.Finished,
		"orphan_containers", sum.OrphanContainers, "orphan_mounts", sum.OrphanMounts,
		"orphan_loops", sum.OrphanLoops, "orphan_files", sum.Orphan, "errors", len(sum.Errors))
	for _, e := range sum.Errors {
		s.log.Warn("reconcile", "err", e)
	}
	return nil
}

func (s *Service) reconcileOne(ctx context.Context, rec *sandbox.Record, sum *reconcileSummary) {
	e := s.boxes[rec.ID]
	t := newTask(s.store, e, rec, nil)
	if rec.State == lifecycle.Creating && rec.PoolToken != "" {
		// A warm pool claim whose record was written: finish it.
		err := s.finishClaim(ctx, t)
		if err == nil {
			s.log.Info("reconcile: finished a warm pool claim cut short", "sandbox_id", rec.ID, "pool_entry", rec.HostKey())
			sum.Adopted++
			return
		}
		sum.Errors = append(sum.Errors, fmt.Sprintf("%s: %v (undone)", rec.ID, err))
	}
	switch rec.State {
	case lifecycle.Creating, lifecycle.Destroying, lifecycle.Destroyed:
		if _, err := s.engine.Run(ctx, FlowCleanup, t); err != nil {
			_ = t.Update(func(r *sandbox.Record) { r.State = lifecycle.Destroying; r.Error = err.Error() })
			s.journal(rec.ID, err)
			sum.Errors = append(sum.Errors, fmt.Sprintf("%s: %v", rec.ID, err))
			return
		}
		if err := s.store.FinishDestroy(rec.ID); err == nil {
			delete(s.boxes, rec.ID)
			s.usage.Forget(rec.ID)
		}
		sum.Finished++
		return
	case lifecycle.Failed:
		if rec.Disk != nil || rec.Mount != nil || rec.Container != nil || rec.Network != nil {
			s.release(ctx, t, sum)
		}
		sum.Failed++
		return
	case lifecycle.Paused:
		if rec.PauseMode == sandbox.PauseDisk { // no runtime container by design
			s.adoptDiskPaused(ctx, t, sum)
			return
		}
	}
	if rec.PauseMode != sandbox.PauseDisk && s.pausedImageStopped(ctx, rec) {
		// A pause to disk cut short between its checkpoint (the image
		// complete, the runtime sandbox stopped) and the record saying
		// so: finish the pause rather than fail the sandbox. One update:
		// a record Running with no live process would arm the watch,
		// which would mark it dead.
		_ = t.Update(func(r *sandbox.Record) { r.State, r.PauseMode = lifecycle.Paused, sandbox.PauseDisk })
		rec = t.Record()
	}
	if rec.PauseMode == sandbox.PauseDisk {
		// A pause to disk was cut short after its memory image was
		// complete. Without a live container the sandbox is disk-paused;
		// with one the pause never evicted it and it is adopted as is.
		if st, err := s.runtimeState(ctx, rec); errdefs.IsNotFound(err) || (err == nil && st.Status == runtime.StatusStopped) {
			_ = t.Update(func(r *sandbox.Record) { r.State = lifecycle.Paused })
			s.adoptDiskPaused(ctx, t, sum)
			return
		}
		_ = t.Update(func(r *sandbox.Record) { r.PauseMode = "" })
		rec = t.Record()
	}
	s.sweepPausedImage(rec)

	state, err := s.runtimeState(ctx, rec)
	if stopped := errdefs.IsNotFound(err) || (err == nil && state.Status == runtime.StatusStopped); stopped && rec.State == lifecycle.Snapshotting {
		// A snapshot cut short between its checkpoint (which stops the
		// sandbox) and the restore in place: the image it wrote is the
		// sandbox, so it is restored from it (same ID, memory intact).
		if rerr := s.restoreInterrupted(ctx, t); rerr != nil {
			sum.Errors = append(sum.Errors, fmt.Sprintf("%s: restore from the interrupted snapshot's image: %v", rec.ID, rerr))
		} else {
			rec = t.Record()
			state, err = s.runtimeState(ctx, rec)
		}
	}
	switch {
	case err == nil && (state.Status == runtime.StatusRunning || state.Status == runtime.StatusPaused):
		st := lifecycle.Running
		if state.Status == runtime.StatusPaused {
			st = lifecycle.Paused
		}
		_ = t.Update(func(r *sandbox.Record) {
			r.State, r.Error = st, ""
			r.Container.PID = state.PID
			r.PauseMode = ""
			if st == lifecycle.Paused {
				r.PauseMode = sandbox.PauseMemory
			}
		})
		sum.Adopted++
	case err == nil || errdefs.IsNotFound(err):
		why := "sandbox died while cubelet was down"
		if err == nil {
			why += " (runtime status " + string(state.Status) + ")"
		}
		_ = t.Update(func(r *sandbox.Record) { r.State, r.Error = lifecycle.Failed, why })
		s.release(ctx, t, sum)
		sum.Failed++
	default:
		_ = t.Update(func(r *sandbox.Record) { r.State, r.Error = lifecycle.Unknown, err.Error() })
		sum.Unknown++
	}
}

func (s *Service) runtimeState(ctx context.Context, rec *sandbox.Record) (runtime.State, error) {
	if rec.Container == nil {
		return runtime.State{}, fmt.Errorf("no container: %w", errdefs.ErrNotFound)
	}
	d, err := s.node.Driver(rec.Runtime)
	if err != nil {
		return runtime.State{}, err
	}
	return d.State(ctx, rec.Container.ID)
}

// release frees what a dead sandbox still holds, keeping its record.
func (s *Service) release(ctx context.Context, t *actions.Task, sum *reconcileSummary) {
	if _, err := s.engine.Run(ctx, FlowCleanup, t); err != nil {
		sum.Errors = append(sum.Errors, fmt.Sprintf("%s: release: %v", t.Record().ID, err))
	}
}

func (s *Service) sweepOrphans(ctx context.Context, known map[string]bool, sum *reconcileSummary) {
	errf := func(f string, a ...any) { sum.Errors = append(sum.Errors, fmt.Sprintf(f, a...)) }
	for name, d := range s.node.Drivers {
		states, err := d.List(ctx)
		if err != nil {
			errf("list %s containers: %v", name, err)
			continue
		}
		for _, st := range states {
			if known[st.ID] {
				continue
			}
			if err := d.Stop(ctx, st.ID); err != nil {
				errf("stop orphan container %s: %v", st.ID, err)
				continue
			}
			sum.OrphanContainers++
		}
	}
	runRoot := filepath.Join(s.cfg.Node.RunDir, "sandboxes")
	for _, id := range dirNames(runRoot) {
		if known[id] {
			// Host mounts are staged only while a sandbox starts, and
			// nothing starts during start-up: these are a crash's.
			if err := hostbind.Unstage(s.node.HostMountsDir(id)); err != nil {
				errf("unstage %s: %v", id, err)
			}
			continue
		}
		target := filepath.Join(runRoot, id, "rootfs")
		if m, _ := storage.IsMounted(target); m {
			sum.OrphanMounts++
		}
		if err := storage.UnmountDisk(ctx, target, s.node.Pool.SandboxDiskPath(id)); err != nil {
			errf("unmount orphan %s: %v", target, err)
			continue
		}
		// Staged host mounts first: RemoveAll would reach through one
		// into the host directory it binds.
		if err := hostbind.Unstage(s.node.HostMountsDir(id)); err != nil {
			errf("unstage orphan %s: %v", id, err)
			continue
		}
		if err := os.RemoveAll(filepath.Join(runRoot, id)); err != nil {
			errf("remove %s: %v", id, err)
			continue
		}
		sum.Orphan++
	}
	diskRoot := filepath.Dir(s.node.Pool.SandboxDir("x"))
	if devs, err := loopdev.List(); err == nil {
		for _, d := range devs {
			id := filepath.Base(filepath.Dir(d.BackingFile))
			if strings.HasPrefix(d.BackingFile, diskRoot+"/") && !known[id] {
				if err := loopdev.Detach(d.Path); err == nil {
					sum.OrphanLoops++
				}
			}
		}
	}
	for _, id := range dirNames(diskRoot) {
		if known[id] {
			continue
		}
		if err := s.node.Pool.RemoveSandboxDisk(id); err != nil {
			errf("remove orphan disk %s: %v", id, err)
			continue
		}
		sum.Orphan++
	}
	s.sweepTemplates(sum)
	n, errs := s.node.Net.SweepOrphans(ctx, known)
	sum.Orphan += n
	sum.Errors = append(sum.Errors, errs...)
}

// sweepTemplates removes template directories that no record names (an
// import that died half-way) and the import scratch area.
func (s *Service) sweepTemplates(sum *reconcileSummary) {
	tmpls, err := s.store.ListTemplates()
	if err != nil {
		return
	}
	known := map[string]bool{}
	for _, t := range tmpls {
		known[t.ID] = true
	}
	root := filepath.Dir(filepath.Dir(s.node.Pool.TemplateImagePath("x")))
	for _, id := range dirNames(root) {
		if !known[id] {
			if os.RemoveAll(filepath.Join(root, id)) == nil {
				sum.Orphan++
			}
		}
	}
	_ = os.RemoveAll(s.scratchDir())
}

func (s *Service) scratchDir() string { return filepath.Join(s.node.Pool.Dir(), "tmp") }

func dirNames(dir string) []string {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	var out []string
	for _, e := range ents {
		if e.IsDir() {
			out = append(out, e.Name())
		}
	}
	return out
}

// gcLoop retries journalled destroys with exponential backoff until they
// succeed, and runs snapshot and template GC, until ctx (the service's
// lifetime, ended by Close) is done.
func (s *Service) gcLoop(ctx context.Context) {
	defer close(s.gcDone)
	tick := time.NewTicker(s.cfg.GC.Interval.Duration)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case <-s.kick:
		}
		// Each pass stops at Close: a GC that read a list cut short by the
		// cancelled context must not judge what it missed unused.
		for _, pass := range []func(context.Context){s.runJournal, s.snapshotGC, s.templateGC} {
			if ctx.Err() != nil {
				return
			}
			pass(ctx)
		}
	}
}

func (s *Service) runJournal(ctx context.Context) {
	entries, err := s.store.ListJournal()
	if err != nil {
		s.log.Error("read cleanup journal", "err", err)
		return
	}
	sort.Slice(entries, func(i, j int) bool { return entries[i].NextAttempt.Before(entries[j].NextAttempt) })
	for _, j := range entries {
		if ctx.Err() != nil {
			return
		}
		if time.Now().Before(j.NextAttempt) {
			continue
		}
		s.retryCleanup(ctx, j)
	}
}

func (s *Service) retryCleanup(ctx context.Context, j *sandbox.JournalEntry) {
	s.mu.Lock()
	e := s.boxes[j.SandboxID]
	s.mu.Unlock()
	if e == nil {
		_ = s.store.DeleteJournal(j.SandboxID)
		return
	}
	select {
	case e.lock <- struct{}{}:
	default:
		return // someone is working on it (a user's delete): try next round
	}
	defer e.release()
	t := newTask(s.store, e, e.rec.Load(), nil)
	_, err := s.engine.Run(ctx, FlowCleanup, t)
	if err == nil {
		if err := s.store.FinishDestroy(j.SandboxID); err == nil {
			s.forget(j.SandboxID)
			s.log.Info("journalled destroy finished", "sandbox_id", j.SandboxID, "attempts", j.Attempts+1)
		}
		return
	}
	if ctx.Err() != nil {
		// Interrupted by Close: not a failed attempt. The entry stays as
		// it was and the next start retries it.
		s.log.Info("journalled destroy interrupted by shutdown", "sandbox_id", j.SandboxID, "err", err)
		return
	}
	j.Attempts++
	j.LastError = err.Error()
	backoff := time.Second << min(j.Attempts, 16)
	if backoff > s.cfg.GC.MaxBackoff.Duration {
		backoff = s.cfg.GC.MaxBackoff.Duration
	}
	j.NextAttempt = time.Now().Add(backoff)
	if perr := s.store.PutJournal(j); perr != nil {
		err = errors.Join(err, perr)
	}
	s.log.Warn("journalled destroy failed again", "sandbox_id", j.SandboxID, "attempts", j.Attempts, "next_in", backoff, "err", err)
}

// restoreInterrupted brings back a sandbox whose snapshot a crash cut
// short after the runtime's checkpoint stopped it and before the restore
// in place: from the memory image the half-taken snapshot holds (complete:
// the runtime stops the sandbox only once the image is written), then
// frozen again if it was paused. The agent in the image is quiesced;
// reconcileSnapshots wakes it with the other interrupted verbs, and
// removes the half-taken snapshot and its image afterwards.
func (s *Service) restoreInterrupted(ctx context.Context, t *actions.Task) error {
	rec := t.Record()
	if rec.Container == nil {
		return fmt.Errorf("no container: %w", errdefs.ErrNotFound)
	}
	d, err := s.node.Driver(rec.Runtime)
	if err != nil {
		return err
	}
	r, ok := d.(runtime.InPlaceRestorer)
	if !ok {
		return fmt.Errorf("runtime %s cannot restore in place: %w", rec.Runtime, errdefs.ErrNotImplemented)
	}
	dir, err := s.interruptedImage(rec.ID)
	if err != nil {
		return err
	}
	st, err := r.RestoreInPlace(ctx, rec.Container.ID, dir)
	if br, ok := d.(runtime.BundleRestorer); ok && errdefs.IsNotFound(err) && rec.Container.Bundle != "" {
		// The crash came inside the restore in place, after it removed
		// the stopped sandbox: the runtime no longer knows the ID, the
		// bundle still says how to run it.
		st, err = br.RestoreBundle(ctx, rec.Container.ID, rec.Container.Bundle, dir)
	}
	if err != nil {
		return err
	}
	if err := t.Update(func(r *sandbox.Record) { r.Container.PID = st.PID }); err != nil {
		return err
	}
	if rec.PrevState == lifecycle.Paused {
		return actions.Settle(ctx, d, rec.Container.ID, runtime.StatusPaused, d.Pause(ctx, rec.Container.ID))
	}
	s.log.Info("sandbox restored from the image of a snapshot a crash interrupted", "sandbox_id", rec.ID, "image", dir)
	return nil
}

// interruptedImage finds the memory image of sandboxID's half-taken
// snapshot.
func (s *Service) interruptedImage(sandboxID string) (string, error) {
	recs, err := s.store.ListSnapshots()
	if err != nil {
		return "", err
	}
	for _, sn := range recs {
		if sn.SandboxID != sandboxID || sn.State == sandbox.SnapshotReady {
			continue
		}
		dir := s.node.Pool.SnapshotMemoryDir(sn.ID)
		if ents, err := os.ReadDir(dir); err == nil && len(ents) > 0 {
			return dir, nil
		}
	}
	return "", fmt.Errorf("no memory image of a half-taken snapshot of %s: %w", sandboxID, errdefs.ErrNotFound)
}

// pausedImageStopped reports whether rec's runtime sandbox is stopped (or
// gone) while a memory image of a pause to disk is in its pool directory:
// the checkpoint stops the sandbox only once the image is complete.
func (s *Service) pausedImageStopped(ctx context.Context, rec *sandbox.Record) bool {
	if rec.Container == nil || (rec.State != lifecycle.Running && rec.State != lifecycle.Paused) {
		return false
	}
	if ents, err := os.ReadDir(s.node.PausedImageDir(rec.HostKey())); err != nil || len(ents) == 0 {
		return false
	}
	st, err := s.runtimeState(ctx, rec)
	return errdefs.IsNotFound(err) || (err == nil && st.Status == runtime.StatusStopped)
}
