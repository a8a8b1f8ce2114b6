// Package cubelet is the node daemon: it owns every sandbox on its node end
// to end. Service is the in-process API; the gRPC server in package
// cubeletapi is a thin adapter over it, so the CLI's tests and the e2e
// suites can drive the same object.
//
// Concurrency: one lock per sandbox (held for the whole of a flow); readers
// never take it. Different sandboxes never wait on each other: the only
// shared lock (s.mu) guards the map of sandboxes and is held for map
// operations only.
package cubelet

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/cubesandbox/cube/internal/cubelet/actions"
	"github.com/cubesandbox/cube/internal/cubelet/config"
	"github.com/cubesandbox/cube/internal/cubelet/masterlink"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/network/policy"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/sandboxid"
	"github.com/cubesandbox/cube/internal/store"
	"github.com/cubesandbox/cube/internal/workflow"
)

// Service is one node's cubelet.
type Service struct {
	cfg     *config.Config
	log     *slog.Logger
	store   *store.Store
	engine  *workflow.Engine[*actions.Task]
	node    *actions.Node
	metrics *prometheus.Registry

	mu    sync.Mutex
	boxes map[string]*entry // by sandbox ID; every record in the store has one

	tmplMu    sync.Mutex
	importing map[string]bool // template IDs being imported
	// unusedSince is when template GC first saw each template unused.
	unusedSince map[string]time.Time

	snaps snapRefs // in-flight users of snapshots (snapshots.go)

	stopGC chan struct{}
	// closeOnce makes Close idempotent (tests and the daemon may both call it).
	closeOnce sync.Once
	gcDone    chan struct{}
	kick      chan struct{}    // wakes the GC loop early
	hb        *masterlink.Link // nil when no master is configured
}

// New opens the store, runs the init flow, reconciles the store with what
// really exists on the node, and starts the cleanup loop. The caller
// serves the API afterwards.
func New(ctx context.Context, cfg *config.Config, log *slog.Logger) (*Service, error) {
	if log == nil {
		log = slog.Default()
	}
	for _, d := range []string{cfg.Node.DataDir, cfg.Node.RunDir, filepath.Join(cfg.Node.RunDir, "sandboxes")} {
		if err := os.MkdirAll(d, 0o711); err != nil {
			return nil, err
		}
	}
	st, err := store.Open(cfg.StorePath())
	if err != nil {
		return nil, err
	}
	s := &Service{
		cfg:       cfg,
		log:       log,
		store:     st,
		node:      actions.NewNode(cfg),
		metrics:   prometheus.NewRegistry(),
		boxes:     map[string]*entry{},
		importing: map[string]bool{},
		stopGC:    make(chan struct{}),
		gcDone:    make(chan struct{}),
		kick:      make(chan struct{}, 1),
	}
	ok := false
	defer func() {
		if !ok {
			s.stopStorage() // the disk pool's refiller, if it started
			st.Close()
		}
	}()
	s.metrics.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), &stateCollector{s: s})

	reg := workflow.NewRegistry()
	actions.Register(s.node, reg)
	s.engine, err = workflow.New(reg, actions.Verbs(), cfg.Flows,
		workflow.WithMetrics(s.metrics, "cubelet"),
		workflow.WithLogger(log),
		workflow.WithFailpoints(true))
	if err != nil {
		return nil, err
	}
	if _, err := s.engine.Run(ctx, FlowInit, nil); err != nil {
		return nil, fmt.Errorf("init flow: %w", err)
	}
	if err := s.reconcile(ctx); err != nil {
		return nil, fmt.Errorf("reconcile: %w", err)
	}
	if err := s.startStorage(ctx); err != nil {
		return nil, fmt.Errorf("storage: %w", err)
	}
	if s.hb, err = masterlink.Start(cfg.Master, s.NodeReport, log); err != nil {
		return nil, fmt.Errorf("master: %w", err)
	}
	go s.gcLoop()
	ok = true
	return s, nil
}

// Close stops the background loops and closes the store. Sandboxes keep
// running: a restarted cubelet adopts them.
func (s *Service) Close() error {
	var err error
	s.closeOnce.Do(func() {
		s.hb.Stop()
		close(s.stopGC)
		<-s.gcDone
		s.stopStorage()
		err = s.store.Close()
	})
	return err
}

// Metrics is the registry served on /metrics.
func (s *Service) Metrics() *prometheus.Registry { return s.metrics }

// Config returns the configuration the service runs with.
func (s *Service) Config() *config.Config { return s.cfg }

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
	// Network is the egress policy; nil = the default (internet allowed).
	Network *policy.Policy
	// cold boots even when the template is warm (warming it).
	cold bool
}

// Result is a sandbox and the timings of the flow that produced it.
type Result struct {
	Sandbox *sandbox.Record
	Timings []workflow.Timing
	// Warm: restored from the template's warm snapshot (warm.go).
	Warm     bool
	Warnings []string
	// Flow is the flow that ran when the verb picks one (pause, resume:
	// pausemode.go); empty otherwise.
	Flow string
}

// FieldError is an InvalidArgument about one request field.
type FieldError struct {
	Field string
	Msg   string
}

func (e *FieldError) Error() string { return e.Field + ": " + e.Msg }
func (e *FieldError) Unwrap() error { return errdefs.ErrInvalidArgument }

func fieldErr(field, f string, a ...any) error {
	return &FieldError{Field: field, Msg: fmt.Sprintf(f, a...)}
}

var (
	labelKeyRE = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9._/-]{0,251}[A-Za-z0-9])?$`)
	envKeyRE   = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
)

const maxMapEntries = 256

func validateMap(field string, m map[string]string, keyRE *regexp.Regexp, maxVal int) error {
	if len(m) > maxMapEntries {
		return fieldErr(field, "%d entries, at most %d", len(m), maxMapEntries)
	}
	for k, v := range m {
		if !keyRE.MatchString(k) {
			return fieldErr(field, "invalid key %q", k)
		}
		if len(v) > maxVal {
			return fieldErr(field, "value of %q is %d bytes, at most %d", k, len(v), maxVal)
		}
	}
	return nil
}

func (s *Service) validateCreate(req *CreateRequest) (*sandbox.Template, error) {
	if req.SandboxID != "" {
		if err := sandboxid.Validate("sandbox", req.SandboxID); err != nil {
			return nil, &FieldError{Field: "sandbox_id", Msg: err.Error()}
		}
	}
	if req.TemplateID == "" {
		return nil, fieldErr("template_id", "required")
	}
	if err := sandboxid.Validate("template", req.TemplateID); err != nil {
		return nil, &FieldError{Field: "template_id", Msg: err.Error()}
	}
	tmpl, err := s.store.GetTemplate(req.TemplateID)
	if err != nil {
		return nil, err
	}
	if req.Runtime == "" {
		req.Runtime = tmpl.Runtime
	}
	if req.Runtime == "" {
		req.Runtime = s.cfg.Node.DefaultRuntime
	}
	if _, ok := s.node.Drivers[req.Runtime]; !ok {
		return nil, fieldErr("runtime", "%q is not available on this node", req.Runtime)
	}
	if err := s.runtimeUsable(req.Runtime); err != nil {
		return nil, err
	}
	c := s.cfg.Sandbox
	r := &req.Resources
	for _, l := range []struct {
		field    string
		v        *int64
		def, max int64
	}{
		{"resources.milli_cpu", &r.MilliCPU, c.DefaultMilliCPU, c.MaxMilliCPU},
		{"resources.memory_mib", &r.MemoryMiB, c.DefaultMemoryMiB, c.MaxMemoryMiB},
		{"resources.pids", &r.Pids, c.DefaultPids, c.MaxPids},
		{"resources.disk_mib", &r.DiskMiB, 0, c.MaxDiskMiB},
	} {
		switch {
		case *l.v < 0:
			return nil, fieldErr(l.field, "%d is negative", *l.v)
		case *l.v > l.max:
			return nil, fieldErr(l.field, "%d exceeds the node maximum %d", *l.v, l.max)
		case *l.v == 0:
			*l.v = l.def
		}
	}
	if r.MemoryMiB < 16 {
		return nil, fieldErr("resources.memory_mib", "%d MiB is below the 16 MiB minimum", r.MemoryMiB)
	}
	if err := validateMap("labels", req.Labels, labelKeyRE, 256); err != nil {
		return nil, err
	}
	if err := validateMap("annotations", req.Annotations, labelKeyRE, 64<<10); err != nil {
		return nil, err
	}
	if err := validateMap("env", req.Env, envKeyRE, 128<<10); err != nil {
		return nil, err
	}
	if len(req.RequestID) > 128 {
		return nil, fieldErr("request_id", "longer than 128 bytes")
	}
	if req.HostMounts, err = checkHostMounts(s.cfg, req.HostMounts); err != nil {
		return nil, err
	}
	if err := s.node.Net.CheckPolicy(req.Network); err != nil {
		return nil, err
	}
	return tmpl, nil
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
	if sn := s.warmSnapshotFor(tmpl, &req); sn != nil {
		return s.createWarm(ctx, req, sn)
	}
	now := time.Now().UTC()
	rec := &sandbox.Record{
		ID: req.SandboxID, TemplateID: req.TemplateID, Runtime: req.Runtime,
		State: lifecycle.Creating, Labels: req.Labels, Annotations: req.Annotations,
		Env: req.Env, Resources: req.Resources, RequestID: req.RequestID,
		HostMounts: req.HostMounts, CreatedAt: now, UpdatedAt: now,
		NetworkPolicy: req.Network,
	}
	e := newEntry(rec)
	_ = e.acquire(context.Background()) // fresh entry: never blocks
	defer e.release()
	s.mu.Lock()
	if _, dup := s.boxes[rec.ID]; dup {
		s.mu.Unlock()
		return nil, fmt.Errorf("sandbox %q: %w", rec.ID, errdefs.ErrAlreadyExists)
	}
	s.boxes[rec.ID] = e
	s.mu.Unlock()
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
		if err := s.store.FinishDestroy(rec.ID); err != nil {
			log.Error("remove record of failed create", "err", err)
			return
		}
		s.forget(rec.ID)
		log.Info("create failed and was undone", "err", cause)
		return
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
}

func (s *Service) lookup(id string) (*entry, error) {
	if err := sandboxid.Validate("sandbox", id); err != nil {
		return nil, &FieldError{Field: "sandbox_id", Msg: err.Error()}
	}
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
	s.mu.Lock()
	recs := make([]*sandbox.Record, 0, len(s.boxes))
	for _, e := range s.boxes {
		recs = append(recs, e.rec.Load())
	}
	s.mu.Unlock()
	out := recs[:0]
	for _, r := range recs {
		if matches(r, f) {
			out = append(out, r.Clone())
		}
	}
	sortRecords(out)
	return out, nil
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

// Pause freezes a running sandbox, its memory resident (PauseTo, in
// pausemode.go, also pauses to disk).
func (s *Service) Pause(ctx context.Context, id string) (*Result, error) {
	return s.PauseTo(ctx, id, sandbox.PauseMemory)
}

// Resume thaws a paused sandbox, or restores a disk-paused one from its
// memory image, and returns once its agent answers.
func (s *Service) Resume(ctx context.Context, id string) (*Result, error) {
	return s.pauseModeVerb(ctx, id, FlowResume, lifecycle.Running, "")
}

// Delete destroys a sandbox and everything it holds. If the destroy fails
// the sandbox stays Destroying, is journalled, and the cleanup loop
// retries until it succeeds; deleting it again retries at once.
func (s *Service) Delete(ctx context.Context, id string) (*Result, error) {
	e, err := s.lookup(id)
	if err != nil {
		return nil, err
	}
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

// FlowInfo describes one flow for admin tools.
type FlowInfo struct {
	Name     string
	Limit    int
	InFlight int
	Steps    [][]string
}

// Flows lists the configured flows with their live limits.
func (s *Service) Flows() []FlowInfo {
	limits := s.engine.Limits()
	var out []FlowInfo
	for _, f := range s.engine.Flows() {
		l := limits[f]
		out = append(out, FlowInfo{Name: f, Limit: l.Limit, InFlight: l.InFlight, Steps: s.engine.Steps(f)})
	}
	return out
}

// SetFlowLimit changes a flow's concurrency limit at run time.
func (s *Service) SetFlowLimit(flow string, limit int) (FlowInfo, error) {
	if err := s.engine.SetLimit(flow, limit); err != nil {
		return FlowInfo{}, err
	}
	for _, f := range s.Flows() {
		if f.Name == flow {
			return f, nil
		}
	}
	return FlowInfo{}, fmt.Errorf("flow %q: %w", flow, errdefs.ErrNotFound)
}

// ReloadFlows swaps in the flows of a new config (SIGHUP). Other settings
// need a restart.
func (s *Service) ReloadFlows(cfg *config.Config) error {
	return s.engine.Reload(cfg.Flows)
}
