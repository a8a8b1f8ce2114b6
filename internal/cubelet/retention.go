package cubelet

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet/actions"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// enforceRetention deletes the snapshots that [snapshots] says are too
// many or too old: older than max_age; beyond max_per_sandbox of one
// sandbox (only sandboxID's when it is set, every sandbox's otherwise);
// beyond max_per_node. The oldest go first, so the snapshot just taken is
// the last to go. Snapshots a clone or rollback is reading lose their
// record now and their files when that finishes.
func (s *Service) enforceRetention(ctx context.Context, sandboxID string) {
	c := s.cfg.Snapshots
	if c.MaxAge.Duration == 0 && c.MaxPerSandbox == 0 && c.MaxPerNode == 0 {
		return
	}
	listed, err := s.ListSnapshots(ctx, SnapshotFilter{})
	if err != nil {
		s.log.Warn("retention: list snapshots", "err", err)
		return
	}
	// Warm snapshots belong to their template, not to retention.
	all := listed[:0:0]
	for _, sn := range listed {
		if !s.isWarm(sn) {
			all = append(all, sn)
		}
	}
	doomed := map[string]bool{}
	if c.MaxAge.Duration > 0 {
		cutoff := time.Now().Add(-c.MaxAge.Duration)
		for _, sn := range all {
			if sn.CreatedAt.Before(cutoff) {
				doomed[sn.ID] = true
			}
		}
	}
	if c.MaxPerSandbox > 0 {
		kept := map[string]int{} // per sandbox, counting newest first
		for i := len(all) - 1; i >= 0; i-- {
			sn := all[i]
			if doomed[sn.ID] || (sandboxID != "" && sn.SandboxID != sandboxID) {
				continue
			}
			if kept[sn.SandboxID]++; kept[sn.SandboxID] > c.MaxPerSandbox {
				doomed[sn.ID] = true
			}
		}
	}
	if c.MaxPerNode > 0 {
		kept := 0
		for i := len(all) - 1; i >= 0; i-- {
			if sn := all[i]; !doomed[sn.ID] {
				if kept++; kept > c.MaxPerNode {
					doomed[sn.ID] = true
				}
			}
		}
	}
	for _, sn := range all {
		if doomed[sn.ID] {
			if err := s.removeSnapshot(sn, "expired by retention"); err != nil {
				s.log.Warn("retention: delete snapshot", "snapshot_id", sn.ID, "err", err)
			}
		}
	}
}

// snapshotGC is the GC loop's share of snapshot housekeeping.
func (s *Service) snapshotGC(ctx context.Context) {
	s.enforceRetention(ctx, "")
	s.sweepSnapshotFiles()
}

// sweepSnapshotFiles removes snapshot directories that no record names
// and no clone or rollback is reading. The directory list is read before
// the records: a snapshot's record is written before its directory, so a
// directory seen here whose record is missing is really an orphan.
func (s *Service) sweepSnapshotFiles() int {
	dir := s.node.Pool.SnapshotsDir()
	ents, err := os.ReadDir(dir)
	if err != nil {
		return 0
	}
	recs, err := s.store.ListSnapshots()
	if err != nil {
		return 0
	}
	known := map[string]bool{}
	for _, sn := range recs {
		known[sn.ID] = true
	}
	n := 0
	for _, e := range ents {
		if known[e.Name()] || s.snaps.inUse(e.Name()) {
			continue
		}
		// An import's staging directory (.<id>.import-*) belongs to its
		// snapshot's record (created before the download); it goes with
		// the record when a crash cut the import off.
		if id, _, ok := strings.Cut(strings.TrimPrefix(e.Name(), "."), ".import-"); ok && strings.HasPrefix(e.Name(), ".") && known[id] {
			continue
		}
		if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
			s.log.Warn("remove orphaned snapshot files", "snapshot", e.Name(), "err", err)
			continue
		}
		n++
	}
	return n
}

// interruptedWakeBound bounds the wake of one agent an interrupted
// snapshot quiesced, at start-up.
const interruptedWakeBound = 20 * time.Second

// reconcileSnapshots runs once at start, after the sandboxes are
// reconciled: it removes the snapshots a crash left half taken, the
// snapshot files no record names, and finishes the snapshot and rollback
// verbs a crash interrupted (thaws a sandbox a snapshot froze, wakes an
// agent it quiesced, removes a rollback's staged disk).
func (s *Service) reconcileSnapshots(ctx context.Context) {
	var halfTaken, settled int
	recs, err := s.store.ListSnapshots()
	if err != nil {
		s.log.Warn("reconcile snapshots", "err", err)
	}
	for _, sn := range recs {
		if sn.State == sandbox.SnapshotReady {
			continue
		}
		if err := s.node.Pool.RemoveSnapshot(sn.ID); err == nil {
			if err := s.store.DeleteSnapshot(sn.ID); err == nil {
				halfTaken++
			}
		}
	}
	orphans := s.sweepSnapshotFiles()

	for _, e := range s.boxes {
		rec := e.rec.Load()
		if rec.PrevState == "" {
			continue
		}
		t := newTask(s.store, e, rec, nil)
		if rec.Disk != nil {
			if err := os.Remove(actions.StagedDisk(rec.Disk.Path)); err != nil && !errors.Is(err, os.ErrNotExist) {
				s.log.Warn("remove staged rollback disk", "sandbox_id", rec.ID, "err", err)
			}
		}
		to := rec.State
		if rec.State == lifecycle.Paused && rec.PrevState == lifecycle.Running {
			// Frozen by a snapshot that never thawed it.
			if err := s.resumeContainer(ctx, rec); err != nil {
				s.log.Warn("thaw sandbox frozen by an interrupted snapshot", "sandbox_id", rec.ID, "err", err)
			} else {
				to = lifecycle.Running
			}
		}
		if to == lifecycle.Running || to == lifecycle.Paused {
			// The snapshot may have quiesced the agent before the crash.
			// Bounded: start-up waits for this, and one sandbox whose
			// agent never answers must not keep the node down.
			wctx, cancel := context.WithTimeout(ctx, interruptedWakeBound)
			err := s.node.WakeInterrupted(wctx, t.Record())
			cancel()
			if err != nil {
				s.log.Warn("wake the agent of a sandbox an interrupted snapshot quiesced", "sandbox_id", rec.ID, "err", err)
			}
		}
		_ = t.Update(func(r *sandbox.Record) { r.State, r.PrevState = to, "" })
		settled++
	}
	s.log.Info("snapshots reconciled", "half_taken_removed", halfTaken, "orphan_dirs_removed", orphans, "interrupted_verbs", settled)
}

func (s *Service) resumeContainer(ctx context.Context, rec *sandbox.Record) error {
	if rec.Container == nil {
		return fmt.Errorf("no container: %w", errdefs.ErrNotFound)
	}
	d, err := s.node.Driver(rec.Runtime)
	if err != nil {
		return err
	}
	return actions.Settle(ctx, d, rec.Container.ID, runtime.StatusRunning, d.Resume(ctx, rec.Container.ID))
}
