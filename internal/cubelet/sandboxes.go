package cubelet

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet/actions"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/network/policy"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/sandboxid"
	"github.com/cubesandbox/cube/internal/workflow"
)

// CreateRequest asks for a new sandbox.
type CreateRequest struct {
	RequestID   string
	SandboxID   string // generated when empty
	TemplateID  string
	Runtime     string // node default when empty
	Labels      map[string]string
	Annotations map[string]string
	Env         map[string]string
	Resources   sandbox.Resources
	// HostMounts are checked against storage.host_mount_allow.
	HostMounts []sandbox.HostMount
	// Volumes are mounted at their paths (actions.MountVolumes).
	Volumes []sandbox.Volume
	// Network is the egress policy; nil = the default (internet allowed).
	Network *policy.Policy
	// AccessToken is what the agent requires on every request from its
	// first ("" = none: the agent serves anyone who reaches it until
	// something sets a token through /init).
	AccessToken string
	// cold boots even when the template is warm (warming it, filling a
	// pool of a runtime whose entries boot). fill never claims a warm
	// pool's entry (filling the pool).
	cold, fill bool
}

// Result is a sandbox and the timings of the flow that produced it.
type Result struct {
	Sandbox *sandbox.Record
	Timings []workflow.Timing
	// Warm: restored from the template's warm snapshot (warm.go).
	Warm bool
	// Pooled: claimed from a warm pool (warmpool.go).
	Pooled   bool
	Warnings []string
	// Flow is the flow that ran when the verb picks one (pause, resume:
	// pause.go); empty otherwise.
	Flow string
}

// Create makes a new sandbox and returns when its agent answers. A failed
// create leaves nothing behind: its flow undoes every started action, and
// if even that fails the sandbox is journalled for the cleanup loop.
func (s *Service) Create(ctx context.Context, req CreateRequest) (*Result, error) {
	tmpl, err := s.validateCreate(&req)
	if err != nil {
		return nil, err
	}
	if req.SandboxID == "" {
		req.SandboxID = sandboxid.New()
	}
	if s.poolClaimable(&req, tmpl) {
		if res, served, err := s.claimPooled(ctx, req, tmpl); served {
			return res, err
		}
	}
	if sn := s.warmSnapshotFor(tmpl, &req); sn != nil {
		return s.createWarm(ctx, req, sn)
	}
	rec := &sandbox.Record{
		ID: req.SandboxID, TemplateID: req.TemplateID, Runtime: req.Runtime,
		State: lifecycle.Creating, Labels: req.Labels, Annotations: req.Annotations,
		Env: req.Env, Resources: req.Resources, RequestID: req.RequestID,
		HostMounts: req.HostMounts, Volumes: req.Volumes,
		NetworkPolicy: req.Network, AccessToken: req.AccessToken,
	}
	s.mu.Lock()
	if _, dup := s.boxes[rec.ID]; dup {
		s.mu.Unlock()
		return nil, fmt.Errorf("sandbox %q: %w", rec.ID, errdefs.ErrAlreadyExists)
	}
	// Stamped under s.mu, like a node report's generated_at: a report
	// generated at or after CreatedAt counts the sandbox (the master drops
	// its reservation on that rule).
	rec.CreatedAt = time.Now().UTC()
	rec.UpdatedAt = rec.CreatedAt
	e := newEntry(rec)
	_ = e.acquire(context.Background()) // fresh entry: never blocks
	e.onPublish = s.watchRecord
	s.boxes[rec.ID] = e
	s.mu.Unlock()
	defer e.release()
	if err := s.store.CreateSandbox(rec); err != nil {
		s.forget(rec.ID)
		return nil, err
	}

	log := s.log.With("sandbox_id", rec.ID, "request_id", req.RequestID)
	t := newTask(s.store, e, rec, tmpl)
	res, err := s.engine.Run(ctx, FlowCreate, t)
	if err != nil {
		s.failedCreate(t, log, err)
		return &Result{Timings: res.Timings}, err
	}
	if err := t.Update(func(r *sandbox.Record) { r.State = lifecycle.Running }); err != nil {
		return nil, err
	}
	log.Info("sandbox created", "duration", res.Duration)
	return &Result{Sandbox: t.Record(), Timings: res.Timings}, nil
}

// failedCreate removes a sandbox whose create flow failed. The flow has
// already undone its actions; whatever the record still names was not
// released and goes to the cleanup journal.
func (s *Service) failedCreate(t *actions.Task, log *slog.Logger, cause error) {
	rec := t.Record()
	if rec.Disk == nil && rec.Mount == nil && rec.Container == nil && rec.Network == nil {
		err := s.store.FinishDestroy(rec.ID)
		if err == nil {
			s.forget(rec.ID)
			log.Info("create failed and was undone", "err", cause)
			return
		}
		// Everything is released but the record stays (a full disk can
		// refuse even a delete): the journal retries the removal, so
		// the node recovers when space returns, not only at a restart.
		log.Error("remove record of failed create; journalled to retry", "err", err)
		cause = fmt.Errorf("%w; removing its record: %w", cause, err)
	}
	log.Error("create failed and its undo was incomplete; journalled for cleanup", "err", cause)
	_ = t.Update(func(r *sandbox.Record) {
		r.State = lifecycle.Destroying
		r.Error = cause.Error()
	})
	s.journal(rec.ID, cause)
}

func (s *Service) forget(id string) {
	s.mu.Lock()
	delete(s.boxes, id)
	s.mu.Unlock()
	s.usage.Forget(id)
}

// lookup finds a user's sandbox: a warm pool's entry is not one.
func (s *Service) lookup(id string) (*entry, error) {
	if err := sandboxid.Validate("sandbox", id); err != nil {
		return nil, &errdefs.FieldError{Field: "sandbox_id", Msg: err.Error()}
	}
	e, err := s.find(id)
	if err == nil && pooled(e.rec.Load()) {
		return nil, fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	return e, err
}

// find finds any sandbox, a warm pool's entry too.
func (s *Service) find(id string) (*entry, error) {
	s.mu.Lock()
	e := s.boxes[id]
	s.mu.Unlock()
	if e == nil {
		return nil, fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	return e, nil
}

// Get returns a sandbox's current record.
func (s *Service) Get(_ context.Context, id string) (*sandbox.Record, error) {
	e, err := s.lookup(id)
	if err != nil {
		return nil, err
	}
	return e.rec.Load().Clone(), nil
}

// ListFilter selects sandboxes: any of States (all when empty) and every
// label in Labels.
type ListFilter struct {
	States []lifecycle.State
	Labels map[string]string
}

// List returns the matching sandboxes, oldest first.
func (s *Service) List(_ context.Context, f ListFilter) ([]*sandbox.Record, error) {
	out, _ := s.listAt(f)
	return out, nil
}

// listAt is List and the time it took the list, stamped under s.mu: every
// sandbox with a CreatedAt at or before it is in the list.
func (s *Service) listAt(f ListFilter) ([]*sandbox.Record, time.Time) {
	s.mu.Lock()
	at := time.Now().UTC()
	recs := make([]*sandbox.Record, 0, len(s.boxes))
	for _, e := range s.boxes {
		recs = append(recs, e.rec.Load())
	}
	s.mu.Unlock()
	out := recs[:0]
	for _, r := range recs {
		if matches(r, f) && !pooled(r) {
			out = append(out, r.Clone())
		}
	}
	sortRecords(out)
	return out, at
}

func matches(r *sandbox.Record, f ListFilter) bool {
	if len(f.States) > 0 {
		found := false
		for _, st := range f.States {
			found = found || st == r.State
		}
		if !found {
			return false
		}
	}
	for k, v := range f.Labels {
		if got, ok := r.Labels[k]; !ok || got != v {
			return false
		}
	}
	return true
}

// transition takes the sandbox's lock, checks that the state machine
// allows from → to for verb, and returns the locked entry.
func (s *Service) lockFor(ctx context.Context, id string, to lifecycle.State, verb string) (*entry, error) {
	e, err := s.lookup(id)
	if err != nil {
		return nil, err
	}
	if err := e.acquire(ctx); err != nil {
		return nil, fmt.Errorf("sandbox %s is busy: %w", id, err)
	}
	cur := e.rec.Load().State
	if err := lifecycle.Check(id, cur, to, verb); err != nil {
		e.release()
		return nil, err
	}
	return e, nil
}

// Delete destroys a sandbox and everything it holds. If the destroy fails
// the sandbox stays Destroying, is journalled, and the cleanup loop
// retries until it succeeds; deleting it again retries at once.
func (s *Service) Delete(ctx context.Context, id string) (*Result, error) {
	e, err := s.lookup(id)
	if err != nil {
		return nil, err
	}
	return s.deleteEntry(ctx, e, id)
}

func (s *Service) deleteEntry(ctx context.Context, e *entry, id string) (*Result, error) {
	if err := e.acquire(ctx); err != nil {
		return nil, fmt.Errorf("sandbox %s is busy: %w", id, err)
	}
	defer e.release()
	cur := e.rec.Load()
	flow := FlowDestroy
	if cur.State == lifecycle.Destroying {
		flow = FlowCleanup
	} else if err := lifecycle.Check(id, cur.State, lifecycle.Destroying, "delete"); err != nil {
		return nil, err
	}
	t := newTask(s.store, e, cur, nil)
	if err := t.Update(func(r *sandbox.Record) { r.State = lifecycle.Destroying }); err != nil {
		return nil, err
	}
	res, err := s.engine.Run(context.WithoutCancel(ctx), flow, t)
	// A destroy that fails during a neighbour's restart (network-agent
	// coming back, a loop device or cgroup still being torn down) mostly
	// succeeds a moment later: retry the cleanup a few times, briefly,
	// before the client is told it failed and the journal takes over.
	for i, wait := range destroyRetries {
		if err == nil || ctx.Err() != nil {
			break
		}
		s.log.Info("destroy failed; retrying", "sandbox_id", id, "attempt", i+2, "in", wait, "err", err)
		time.Sleep(wait)
		var rres workflow.Result
		rres, err = s.engine.Run(context.WithoutCancel(ctx), FlowCleanup, t)
		res.Timings = append(res.Timings, rres.Timings...)
		res.Duration += rres.Duration
	}
	if err != nil {
		s.journal(id, err)
		return &Result{Timings: res.Timings}, fmt.Errorf("destroy %s failed, queued for cleanup: %w", id, err)
	}
	if err := s.store.FinishDestroy(id); err != nil {
		return nil, err
	}
	s.forget(id)
	s.log.Info("sandbox destroyed", "sandbox_id", id, "duration", res.Duration)
	return &Result{Timings: res.Timings}, nil
}

// destroyRetries are the waits before Delete's retries of a failed
// destroy (about 2 s in all, plus the attempts).
var destroyRetries = []time.Duration{250 * time.Millisecond, 500 * time.Millisecond, time.Second}

func (s *Service) journal(id string, cause error) {
	err := s.store.PutJournal(&sandbox.JournalEntry{
		SandboxID: id, Attempts: 1, LastError: cause.Error(), NextAttempt: time.Now().Add(time.Second),
	})
	if err != nil {
		s.log.Error("write cleanup journal", "sandbox_id", id, "err", err)
	}
	select {
	case s.kick <- struct{}{}:
	default:
	}
}
