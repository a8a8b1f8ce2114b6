package cubelet

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet/actions"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/sandboxid"
	"github.com/cubesandbox/cube/internal/storage"
	"github.com/cubesandbox/cube/internal/workflow"
)

// SnapshotRequest asks for a snapshot of one running or paused sandbox.
type SnapshotRequest struct {
	RequestID  string
	SandboxID  string
	SnapshotID string // generated when empty
	Name       string
	Labels     map[string]string
	// Stop destroys the sandbox once the snapshot is taken; the snapshot
	// stays (E2B's "pause to snapshot" on runtimes without memory
	// snapshots).
	Stop bool
}

// SnapshotResult is a snapshot and the timings of the flow that took it.
type SnapshotResult struct {
	Snapshot *sandbox.Snapshot
	Timings  []workflow.Timing
}

// SnapshotFilter selects snapshots: of one sandbox (when set) and with
// every label in Labels.
type SnapshotFilter struct {
	SandboxID string
	Labels    map[string]string
}

const maxNameLen = 128

// Snapshot takes a snapshot of a running or paused sandbox: freeze,
// flush, FICLONE the disk (plus the memory image where the runtime can
// checkpoint), thaw. The sandbox is Snapshotting meanwhile and returns to
// its previous state, also when the snapshot fails; a failed snapshot
// leaves neither record nor file.
func (s *Service) Snapshot(ctx context.Context, req SnapshotRequest) (*SnapshotResult, error) {
	if req.SnapshotID == "" {
		req.SnapshotID = sandboxid.New()
	}
	if err := sandboxid.Validate("snapshot", req.SnapshotID); err != nil {
		return nil, &errdefs.FieldError{Field: "snapshot_id", Msg: err.Error()}
	}
	if len(req.Name) > maxNameLen {
		return nil, errdefs.FieldErrorf("name", "longer than %d bytes", maxNameLen)
	}
	if err := validateMap("labels", req.Labels, labelKeyRE, 256); err != nil {
		return nil, err
	}
	if len(req.RequestID) > 128 {
		return nil, errdefs.FieldErrorf("request_id", "longer than 128 bytes")
	}
	res, err := s.snapshot(ctx, req)
	if err != nil {
		return res, err
	}
	s.enforceRetention(ctx, res.Snapshot.SandboxID)
	if req.Stop {
		if _, err := s.Delete(ctx, req.SandboxID); err != nil {
			return res, fmt.Errorf("snapshot %s taken, but stopping the sandbox failed: %w", res.Snapshot.ID, err)
		}
	}
	return res, nil
}

func (s *Service) snapshot(ctx context.Context, req SnapshotRequest) (*SnapshotResult, error) {
	e, err := s.lockFor(ctx, req.SandboxID, lifecycle.Snapshotting, "snapshot")
	if err != nil {
		return nil, err
	}
	defer e.release()
	cur := e.rec.Load()
	if err := refuseDiskPaused(cur, "snapshot"); err != nil {
		return nil, err
	}
	if cur.Disk == nil || (cur.Mount == nil && !s.node.BootsDisk(cur.Runtime)) {
		return nil, fmt.Errorf("sandbox %s has no disk to snapshot: %w", cur.ID, errdefs.ErrFailedPrecondition)
	}
	pool := s.node.Pool
	sn := &sandbox.Snapshot{
		ID: req.SnapshotID, Name: req.Name, SandboxID: cur.ID, ParentSnapshotID: cur.SourceSnapshotID,
		TemplateID: cur.TemplateID, Runtime: cur.Runtime, Labels: req.Labels,
		CreatedAt: time.Now().UTC(), State: sandbox.SnapshotCreating,
		Dir: pool.SnapshotDir(req.SnapshotID), DiskPath: pool.SnapshotDiskPath(req.SnapshotID),
		Resources: cur.Resources, Env: cur.Env, NetworkPolicy: cur.NetworkPolicy, AccessToken: cur.AccessToken,
	}
	// The record first: whatever the flow writes, reconcile can find.
	if err := s.store.CreateSnapshot(sn); err != nil {
		return nil, err
	}
	log := s.log.With("sandbox_id", cur.ID, "snapshot_id", sn.ID, "request_id", req.RequestID)
	t := newTask(s.store, e, cur, nil)
	t.Snapshot = &actions.SnapshotRun{Snap: sn, Prev: cur.State}
	if err := t.Update(func(r *sandbox.Record) { r.State, r.PrevState = lifecycle.Snapshotting, cur.State }); err != nil {
		s.discardSnapshot(sn, log)
		return nil, err
	}
	fctx, cancel := detached(ctx)
	defer cancel()
	res, err := s.engine.Run(fctx, FlowSnapshot, t)
	if err == nil {
		err = s.sealSnapshot(sn)
	}
	if err != nil {
		s.discardSnapshot(sn, log)
		s.settleFailed(context.WithoutCancel(ctx), t, cur.State, err, log)
		return &SnapshotResult{Timings: res.Timings}, err
	}
	if err := t.Update(func(r *sandbox.Record) { r.State, r.PrevState = cur.State, "" }); err != nil {
		return nil, err
	}
	log.Info("snapshot taken", "duration", res.Duration, "bytes", sn.SizeBytes, "has_memory", sn.HasMemory)
	return &SnapshotResult{Snapshot: sn.Clone(), Timings: res.Timings}, nil
}

// sealSnapshot measures the snapshot's files and marks it ready.
func (s *Service) sealSnapshot(sn *sandbox.Snapshot) error {
	size, err := storage.SpaceUsed(sn.DiskPath)
	if err != nil {
		return err
	}
	if sn.HasMemory {
		_ = filepath.WalkDir(sn.MemoryDir, func(p string, d os.DirEntry, err error) error {
			if err == nil && !d.IsDir() {
				n, _ := storage.SpaceUsed(p)
				size += n
			}
			return nil
		})
	}
	sn.SizeBytes = size
	sn.State = sandbox.SnapshotReady
	return s.store.PutSnapshot(sn)
}

// discardSnapshot removes a snapshot that failed to be taken: files
// first, then the record. If the files cannot go, the record stays
// (creating) so restart reconcile finds and removes them.
func (s *Service) discardSnapshot(sn *sandbox.Snapshot, log *slog.Logger) {
	if err := s.node.Pool.RemoveSnapshot(sn.ID); err != nil {
		log.Error("remove files of a failed snapshot; left for reconcile", "err", err)
		return
	}
	if err := s.store.DeleteSnapshot(sn.ID); err != nil {
		log.Error("remove record of a failed snapshot; left for reconcile", "err", err)
	}
}

// settleFailed puts a sandbox whose snapshot or rollback flow failed into the
// state it is really in. When the flow's undo completed that is prev.
// When it did not, the runtime is asked: a sandbox still running or
// paused is kept in that state; anything else is marked Failed and what
// it holds is released.
func (s *Service) settleFailed(ctx context.Context, t *actions.Task, prev lifecycle.State, cause error, log *slog.Logger) {
	to, why := prev, ""
	if errors.Is(cause, workflow.ErrUndoIncomplete) {
		to, why = lifecycle.Failed, cause.Error()
		// A rollback that stopped the sandbox and could not bring it back
		// leaves nothing to keep; otherwise ask the runtime.
		stopped := t.Rollback != nil && t.Rollback.Holds.Holds(actions.Stopped)
		if rec := t.Record(); rec.Container != nil && !stopped {
			if st, err := s.runtimeState(ctx, rec); err == nil {
				switch st.Status {
				case runtime.StatusRunning:
					to, why = lifecycle.Running, ""
				case runtime.StatusPaused:
					to, why = lifecycle.Paused, ""
				}
			}
		}
	}
	if err := t.Update(func(r *sandbox.Record) { r.State, r.PrevState, r.Error = to, "", why }); err != nil {
		log.Error("record state after failed verb", "err", err)
	}
	if to == lifecycle.Failed {
		log.Error("verb failed and could not be undone; sandbox marked failed and released", "err", cause)
		if _, err := s.engine.Run(ctx, FlowCleanup, t); err != nil {
			log.Error("release failed sandbox; delete it to retry", "err", err)
		}
	}
}

// GetSnapshot returns one ready snapshot.
func (s *Service) GetSnapshot(_ context.Context, id string) (*sandbox.Snapshot, error) {
	if err := sandboxid.Validate("snapshot", id); err != nil {
		return nil, &errdefs.FieldError{Field: "snapshot_id", Msg: err.Error()}
	}
	sn, err := s.store.GetSnapshot(id)
	if err != nil {
		return nil, err
	}
	if sn.State != sandbox.SnapshotReady {
		return nil, fmt.Errorf("snapshot %q is still being taken: %w", id, errdefs.ErrNotFound)
	}
	return sn, nil
}

// ListSnapshots returns the matching ready snapshots, oldest first.
func (s *Service) ListSnapshots(_ context.Context, f SnapshotFilter) ([]*sandbox.Snapshot, error) {
	if f.SandboxID != "" {
		if err := sandboxid.Validate("sandbox", f.SandboxID); err != nil {
			return nil, &errdefs.FieldError{Field: "sandbox_id", Msg: err.Error()}
		}
	}
	all, err := s.store.ListSnapshots()
	if err != nil {
		return nil, err
	}
	out := all[:0]
	for _, sn := range all {
		if sn.State != sandbox.SnapshotReady || (f.SandboxID != "" && sn.SandboxID != f.SandboxID) {
			continue
		}
		match := true
		for k, v := range f.Labels {
			if got, ok := sn.Labels[k]; !ok || got != v {
				match = false
			}
		}
		if match {
			out = append(out, sn)
		}
	}
	return out, nil
}

// DeleteSnapshot removes a snapshot. Its files go at once, or, while a
// clone or rollback is still reading them, when the last one is done.
// Sandboxes cloned or rolled back from it are unaffected: their disks are
// their own clones.
func (s *Service) DeleteSnapshot(ctx context.Context, id string) error {
	sn, err := s.GetSnapshot(ctx, id)
	if err != nil {
		return err
	}
	if err := s.warmOf(sn); err != nil {
		return err
	}
	return s.removeSnapshot(sn, "deleted")
}

// removeSnapshot deletes the record, then the files unless they are in
// use.
func (s *Service) removeSnapshot(sn *sandbox.Snapshot, why string) error {
	if err := s.store.DeleteSnapshot(sn.ID); err != nil {
		return err
	}
	if s.snaps.orphan(sn.ID) {
		s.log.Info("snapshot "+why+"; files kept until its users finish", "snapshot_id", sn.ID)
		return nil
	}
	if err := s.node.Pool.RemoveSnapshot(sn.ID); err != nil {
		// The record is gone: the orphan sweep removes the files later.
		s.log.Warn("remove snapshot files; left for the orphan sweep", "snapshot_id", sn.ID, "err", err)
	}
	s.log.Info("snapshot "+why, "snapshot_id", sn.ID)
	return nil
}

// useSnapshot returns a ready snapshot and holds a reference on its files
// until release is called: a delete meanwhile removes the record but the
// files stay until then.
func (s *Service) useSnapshot(id string) (*sandbox.Snapshot, func(), error) {
	if err := sandboxid.Validate("snapshot", id); err != nil {
		return nil, nil, &errdefs.FieldError{Field: "snapshot_id", Msg: err.Error()}
	}
	s.snaps.mu.Lock()
	defer s.snaps.mu.Unlock()
	// Read under the lock, so a delete cannot slip between the read and
	// the reference.
	sn, err := s.store.GetSnapshot(id)
	if err != nil {
		return nil, nil, err
	}
	if sn.State != sandbox.SnapshotReady {
		return nil, nil, fmt.Errorf("snapshot %q is still being taken: %w", id, errdefs.ErrNotFound)
	}
	s.snaps.add(id)
	var once sync.Once
	return sn, func() { once.Do(func() { s.releaseSnapshot(id) }) }, nil
}

func (s *Service) releaseSnapshot(id string) {
	if s.snaps.drop(id) {
		if err := s.node.Pool.RemoveSnapshot(id); err != nil {
			s.log.Warn("remove files of a deleted snapshot; left for the orphan sweep", "snapshot_id", id, "err", err)
		}
	}
}

// snapRefs counts the in-flight users (clones, rollbacks) of snapshot
// files. Invariant: a snapshot directory is removed only when its record
// is gone AND its count is zero.
type snapRefs struct {
	mu       sync.Mutex
	n        map[string]int
	orphaned map[string]bool // record deleted while in use
}

func (r *snapRefs) add(id string) {
	if r.n == nil {
		r.n = map[string]int{}
	}
	r.n[id]++
}

// drop releases one reference and reports whether the caller must now
// remove the files (the record was deleted meanwhile).
func (r *snapRefs) drop(id string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.n[id]--
	if r.n[id] > 0 {
		return false
	}
	delete(r.n, id)
	if r.orphaned[id] {
		delete(r.orphaned, id)
		return true
	}
	return false
}

// orphan reports whether id is in use, and if so marks its files for
// removal by the last user.
func (r *snapRefs) orphan(id string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.n[id] == 0 {
		return false
	}
	if r.orphaned == nil {
		r.orphaned = map[string]bool{}
	}
	r.orphaned[id] = true
	return true
}

func (r *snapRefs) inUse(id string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.n[id] > 0
}

// templateSnapshots counts the snapshots (any state) made from templateID.
// A template they reference cannot be deleted: a clone needs the
// template's metadata (env, entrypoint) to boot.
func (s *Service) templateSnapshots(templateID string) (int, error) {
	all, err := s.store.ListSnapshots()
	if err != nil {
		return 0, err
	}
	n := 0
	for _, sn := range all {
		// Its own warm snapshot goes with the template.
		if sn.TemplateID == templateID && !(sn.WarmFor == templateID && s.isWarm(sn)) {
			n++
		}
	}
	return n, nil
}
