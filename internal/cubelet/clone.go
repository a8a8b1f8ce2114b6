package cubelet

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"sync"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet/actions"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/network/policy"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/sandboxid"
	"github.com/cubesandbox/cube/internal/workflow"
)

// MaxClones is the most sandboxes one CloneSandbox call creates.
const MaxClones = 100

// CloneRequest asks for Count new sandboxes from one snapshot.
type CloneRequest struct {
	RequestID  string
	SnapshotID string
	Count      int
	// SandboxIDs are optional explicit IDs, one per clone.
	SandboxIDs  []string
	Labels      map[string]string
	Annotations map[string]string
	// Env is merged over the environment the snapshot's sandbox had.
	Env map[string]string
	// Network replaces the egress policy the snapshot's sandbox had; nil
	// keeps that one.
	Network *policy.Policy
	// AccessTokens are the clones' access tokens, one per clone, or none
	// (clones without one). A clone restored from memory is given its
	// token by its reinit, before anything else reaches it.
	AccessTokens []string
}

// CloneResult is the new sandboxes, in request order, and the timings of
// every clone flow.
type CloneResult struct {
	Sandboxes []*sandbox.Record
	Timings   []workflow.Timing
}

// Clone creates Count sandboxes from one snapshot, each with its own
// FICLONE of the snapshot disk, cold-booted (restored from the memory
// image once a runtime can). They boot in parallel, at most
// snapshots.clone_parallelism at a time, each through the clone flow and
// its limiter (over the limit: ResourceExhausted, never a queue).
//
// All or nothing: if any clone fails, the ones already created are
// destroyed and the call fails, so a caller never has to find out which
// of its sandboxes exist. The resources, template and runtime of the
// clones are the snapshot's sandbox's; labels and annotations come from
// the request.
func (s *Service) Clone(ctx context.Context, req CloneRequest) (*CloneResult, error) {
	if err := s.validateClone(&req); err != nil {
		return nil, err
	}
	sn, release, err := s.useSnapshot(req.SnapshotID)
	if err != nil {
		return nil, err
	}
	defer release()
	if _, err := s.node.Driver(sn.Runtime); err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", sn.ID, err)
	}
	tmpl, err := s.store.GetTemplate(sn.TemplateID)
	if err != nil {
		return nil, fmt.Errorf("template of snapshot %s: %w", sn.ID, err)
	}
	netPolicy := sn.NetworkPolicy
	if req.Network != nil {
		netPolicy = req.Network
	}
	if err := s.node.Net.CheckPolicy(netPolicy); err != nil {
		return nil, err
	}
	env := maps.Clone(sn.Env)
	if len(req.Env) > 0 && env == nil {
		env = map[string]string{}
	}
	maps.Copy(env, req.Env)

	now := time.Now().UTC()
	tasks := make([]*actions.Task, req.Count)
	entries := make([]*entry, req.Count)
	for i := range tasks {
		rec := &sandbox.Record{
			ID: req.SandboxIDs[i], TemplateID: sn.TemplateID, Runtime: sn.Runtime,
			State: lifecycle.Creating, Labels: maps.Clone(req.Labels), Annotations: maps.Clone(req.Annotations),
			Env: maps.Clone(env), Resources: sn.Resources, RequestID: req.RequestID,
			SourceSnapshotID: sn.ID, CreatedAt: now, UpdatedAt: now, NetworkPolicy: netPolicy,
		}
		if len(req.AccessTokens) > 0 {
			rec.AccessToken = req.AccessTokens[i]
		}
		e := newEntry(rec)
		_ = e.acquire(context.Background()) // fresh entry: never blocks
		entries[i] = e
		tasks[i] = newTask(s.store, e, rec, tmpl)
		tasks[i].Clone = sn
	}
	if err := s.reserve(entries, tasks); err != nil {
		return nil, err
	}

	par := min(req.Count, s.cfg.Snapshots.CloneParallelism)
	if l := s.engine.Limits()[FlowClone].Limit; l > 0 {
		par = min(par, l)
	}
	errs := make([]error, len(tasks))
	made := make([]bool, len(tasks)) // exists and must be destroyed on failure
	timings := make([][]workflow.Timing, len(tasks))
	sem := make(chan struct{}, par)
	var wg sync.WaitGroup
	for i, t := range tasks {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			timings[i], made[i], errs[i] = s.cloneOne(ctx, entries[i], t)
		})
	}
	wg.Wait()

	res := &CloneResult{}
	for _, ts := range timings {
		res.Timings = append(res.Timings, ts...)
	}
	failed := 0
	var first error
	for i, err := range errs {
		if err != nil {
			failed++
			if first == nil {
				first = fmt.Errorf("clone %d of %d (%s): %w", i+1, req.Count, tasks[i].Record().ID, err)
			}
		}
	}
	if failed == 0 {
		for _, t := range tasks {
			res.Sandboxes = append(res.Sandboxes, t.Record())
		}
		s.log.Info("snapshot cloned", "snapshot_id", sn.ID, "count", req.Count, "request_id", req.RequestID)
		return res, nil
	}
	// All or nothing: destroy what was created.
	var undo []error
	for i, t := range tasks {
		if made[i] {
			if _, err := s.Delete(context.WithoutCancel(ctx), t.Record().ID); err != nil {
				undo = append(undo, err)
			}
		}
	}
	s.log.Warn("clone failed; created clones destroyed", "snapshot_id", sn.ID, "failed", failed,
		"undo_errors", len(undo), "err", first)
	if len(undo) > 0 {
		return res, fmt.Errorf("%w; destroying the clones already made: %w", first, errors.Join(undo...))
	}
	return res, fmt.Errorf("%w (all %d clones rolled back)", first, req.Count)
}

func (s *Service) validateClone(req *CloneRequest) error {
	if req.SnapshotID == "" {
		return errdefs.FieldErrorf("snapshot_id", "required")
	}
	if req.Count < 1 || req.Count > MaxClones {
		return errdefs.FieldErrorf("count", "%d is not between 1 and %d", req.Count, MaxClones)
	}
	switch len(req.SandboxIDs) {
	case 0:
		req.SandboxIDs = make([]string, req.Count)
		for i := range req.SandboxIDs {
			req.SandboxIDs[i] = sandboxid.New()
		}
	case req.Count:
		seen := map[string]bool{}
		for i, id := range req.SandboxIDs {
			if err := sandboxid.Validate("sandbox", id); err != nil {
				return &errdefs.FieldError{Field: fmt.Sprintf("sandbox_ids[%d]", i), Msg: err.Error()}
			}
			if seen[id] {
				return errdefs.FieldErrorf(fmt.Sprintf("sandbox_ids[%d]", i), "%q is given twice", id)
			}
			seen[id] = true
		}
	default:
		return errdefs.FieldErrorf("sandbox_ids", "%d IDs for %d clones", len(req.SandboxIDs), req.Count)
	}
	if len(req.AccessTokens) != 0 && len(req.AccessTokens) != req.Count {
		return errdefs.FieldErrorf("access_tokens", "%d tokens for %d clones", len(req.AccessTokens), req.Count)
	}
	for i, tok := range req.AccessTokens {
		if err := validateToken(tok); err != nil {
			return errdefs.FieldErrorf(fmt.Sprintf("access_tokens[%d]", i), "%v", err)
		}
	}
	if err := validateMap("labels", req.Labels, labelKeyRE, 256); err != nil {
		return err
	}
	if err := validateMap("annotations", req.Annotations, labelKeyRE, 64<<10); err != nil {
		return err
	}
	if err := validateMap("env", req.Env, sandbox.EnvKeyRE, 128<<10); err != nil {
		return err
	}
	if len(req.RequestID) > 128 {
		return errdefs.FieldErrorf("request_id", "longer than 128 bytes")
	}
	return nil
}

// reserve registers every clone's (locked) entry, or none of them if an
// ID is taken.
func (s *Service) reserve(entries []*entry, tasks []*actions.Task) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, e := range entries {
		if id := e.rec.Load().ID; s.boxes[id] != nil {
			return fmt.Errorf("sandbox %q: %w", id, errdefs.ErrAlreadyExists)
		}
	}
	// Stamped under s.mu: see Create.
	now := time.Now().UTC()
	for i, e := range entries {
		tasks[i].Stamp(now)
		e.rec.Store(tasks[i].Record())
		e.onPublish = s.watchRecord
		s.boxes[e.rec.Load().ID] = e
	}
	return nil
}

// cloneOne runs the clone flow for one reserved sandbox and releases its
// lock. A failed flow is undone like a failed create; made reports
// whether the sandbox exists afterwards (and so must be destroyed if
// another clone of the call failed).
func (s *Service) cloneOne(ctx context.Context, e *entry, t *actions.Task) (_ []workflow.Timing, made bool, _ error) {
	defer e.release()
	rec := t.Record()
	if err := s.store.CreateSandbox(rec); err != nil {
		s.forget(rec.ID)
		return nil, false, err
	}
	log := s.log.With("sandbox_id", rec.ID, "snapshot_id", rec.SourceSnapshotID, "request_id", rec.RequestID)
	res, err := s.engine.Run(ctx, FlowClone, t)
	if err != nil {
		s.failedCreate(t, log, err)
		return res.Timings, false, err
	}
	if err := t.Update(func(r *sandbox.Record) { r.State = lifecycle.Running }); err != nil {
		return res.Timings, true, err
	}
	log.Info("sandbox cloned", "duration", res.Duration)
	return res.Timings, true, nil
}
