package workflow

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// ErrUndoIncomplete is wrapped by a Forward run's error when at least one
// undo failed, so the caller knows resources may have leaked (cubelet hands
// such a sandbox to its cleanup journal).
var ErrUndoIncomplete = errors.New("workflow: undo incomplete")

// Option configures an Engine.
type Option func(*options)

type options struct {
	promReg    prometheus.Registerer
	namespace  string
	log        *slog.Logger
	failpoints bool
	wrapErr    func(error) error
	undoBound  time.Duration
}

// WithMetrics exports the engine's metrics, named <namespace>_..., to r:
// action_duration_seconds{flow,action,phase,outcome},
// flow_duration_seconds{flow,outcome}, flow_rejected_total{flow} and
// flow_inflight{flow}. Engines sharing r and namespace share the collectors.
func WithMetrics(r prometheus.Registerer, namespace string) Option {
	return func(o *options) { o.promReg, o.namespace = r, namespace }
}

// WithLogger sets the logger (default: discard).
func WithLogger(l *slog.Logger) Option {
	return func(o *options) { o.log = l }
}

// WithFailpoints makes the engine evaluate failpoints around every action
// (see the package doc). Off by default.
func WithFailpoints(on bool) Option {
	return func(o *options) { o.failpoints = on }
}

// DefaultUndoBound is how long a Forward flow's undo may run unless
// WithUndoBound says otherwise.
const DefaultUndoBound = 2 * time.Minute

// WithUndoBound sets how long a Forward flow's undo may run. The undo
// runs under a context of its own, not the caller's: a create whose
// client went away (or whose deadline passed) must still roll back whole,
// so the undo outlives the caller's cancel, and this bound keeps a hung
// runtime from holding it for ever. d <= 0 keeps the default.
func WithUndoBound(d time.Duration) Option {
	return func(o *options) {
		if d > 0 {
			o.undoBound = d
		}
	}
}

// WithErrorWrap passes every failed flow's error through wrap before Run
// logs and returns it: the daemon classifies errors the actions cannot
// (cubelet names a full filesystem, package nospace). wrap must return a
// non-nil error for a non-nil one.
func WithErrorWrap(wrap func(error) error) Option {
	return func(o *options) { o.wrapErr = wrap }
}

// Engine runs the configured flows. It is safe for concurrent use.
type Engine[T any] struct {
	reg        *Registry
	verbs      map[string]*Verb[T]
	log        *slog.Logger
	failpoints bool
	wrapErr    func(error) error
	undoBound  time.Duration
	m          *metrics

	mu       sync.Mutex          // serialises SetLimit and Reload
	limiters map[string]*limiter // by flow name; never removed, under mu
	flows    atomic.Pointer[map[string]*flow[T]]
}

// New validates verbs and cfg against reg and returns an engine. Every
// problem is reported here, wrapping errdefs.ErrInvalidArgument: a bad verb,
// a flow without a verb, no or empty steps, an unknown or duplicated action,
// an action lacking the verb's capability, a negative limit.
func New[T any](reg *Registry, verbs []Verb[T], cfg Config, opts ...Option) (*Engine[T], error) {
	if reg == nil {
		return nil, errNilRegistry
	}
	o := options{log: slog.New(slog.DiscardHandler), undoBound: DefaultUndoBound}
	for _, opt := range opts {
		opt(&o)
	}
	e := &Engine[T]{
		reg:        reg,
		verbs:      make(map[string]*Verb[T], len(verbs)),
		log:        o.log,
		failpoints: o.failpoints,
		wrapErr:    o.wrapErr,
		undoBound:  o.undoBound,
		limiters:   map[string]*limiter{},
	}
	for i := range verbs {
		v := verbs[i]
		if err := v.validate(); err != nil {
			return nil, err
		}
		if _, dup := e.verbs[v.Name]; dup {
			return nil, fmt.Errorf("workflow: duplicate verb %q: %w", v.Name, errdefs.ErrInvalidArgument)
		}
		e.verbs[v.Name] = &v
	}
	if o.promReg != nil {
		m, err := newMetrics(o.promReg, o.namespace)
		if err != nil {
			return nil, fmt.Errorf("workflow: metrics: %w", err)
		}
		e.m = m
	}
	if err := e.Reload(cfg); err != nil {
		return nil, err
	}
	return e, nil
}

// Reload validates cfg as New does and, if valid, atomically replaces every
// flow's steps and limit. Runs that start afterwards see the new config;
// runs in flight finish with the steps they started with and keep holding
// their limiter slot. An invalid cfg changes nothing.
func (e *Engine[T]) Reload(cfg Config) error {
	flows, err := build(e.reg, e.verbs, cfg)
	if err != nil {
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	for name, f := range flows {
		l := e.limiters[name]
		if l == nil {
			l = &limiter{}
			e.limiters[name] = l
		}
		l.setLimit(cfg[name].Limit)
		f.limiter = l
	}
	e.flows.Store(&flows)
	return nil
}

// SetLimit sets flow's concurrency limit (0 = unlimited) until the next
// Reload. Lowering it below the runs in flight rejects new runs until enough
// finish; it never cancels running ones.
func (e *Engine[T]) SetLimit(flow string, n int) error {
	if n < 0 {
		return fmt.Errorf("workflow: flow %q: negative limit %d: %w", flow, n, errdefs.ErrInvalidArgument)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	f := (*e.flows.Load())[flow]
	if f == nil {
		return fmt.Errorf("workflow: flow %q: %w", flow, errdefs.ErrNotFound)
	}
	f.limiter.setLimit(n)
	return nil
}

// Limits returns the limit and in-flight count of every configured flow.
func (e *Engine[T]) Limits() map[string]FlowLimit {
	flows := *e.flows.Load()
	out := make(map[string]FlowLimit, len(flows))
	for name, f := range flows {
		out[name] = f.limiter.state()
	}
	return out
}

// Flows returns the configured flow names, sorted.
func (e *Engine[T]) Flows() []string {
	return sortedKeys(*e.flows.Load())
}

// Steps returns a copy of flow's steps (action names), or nil if there is no
// such flow.
func (e *Engine[T]) Steps(flow string) [][]string {
	f := (*e.flows.Load())[flow]
	if f == nil {
		return nil
	}
	out := make([][]string, len(f.names))
	for i, s := range f.names {
		out[i] = slices.Clone(s)
	}
	return out
}

// Run runs flow on t according to the flow's verb Mode (see the package
// doc) and returns the timings of everything that ran, also on error.
//
// Errors: an unknown flow wraps errdefs.ErrNotFound; a flow at its limit
// waits up to the flow's queue time for a slot, then wraps
// errdefs.ErrResourceExhausted (at once with no queue);
// otherwise the actions' errors, each prefixed with flow, step and action,
// plus ErrUndoIncomplete when a Forward rollback failed.
func (e *Engine[T]) Run(ctx context.Context, flow string, t T) (Result, error) {
	res := Result{Flow: flow}
	f := (*e.flows.Load())[flow]
	if f == nil {
		return res, fmt.Errorf("workflow: flow %q: %w", flow, errdefs.ErrNotFound)
	}
	if !f.limiter.acquire(ctx, f.queue) {
		e.m.reject(flow)
		waited := ""
		if f.queue > 0 {
			waited = fmt.Sprintf(" (no slot freed within %s)", f.queue)
		}
		return res, fmt.Errorf("workflow: flow %q: concurrency limit of %d reached%s: %w",
			flow, f.limiter.state().Limit, waited, errdefs.ErrResourceExhausted)
	}
	defer f.limiter.release()
	e.m.addInflight(flow, 1)
	defer e.m.addInflight(flow, -1)

	start := time.Now()
	r := &run[T]{e: e, f: f, t: t}
	var err error
	if f.verb.Mode == Teardown {
		err = r.teardown(ctx)
	} else {
		err = r.forward(ctx)
	}
	res.Timings = r.timings
	res.Duration = time.Since(start)
	if err != nil && e.wrapErr != nil {
		err = e.wrapErr(err)
	}
	e.m.observeFlow(flow, res.Duration, err)
	if err != nil {
		e.log.LogAttrs(ctx, slog.LevelWarn, "workflow failed", slog.String("flow", flow),
			slog.Duration("duration", res.Duration), slog.Any("error", err))
	} else {
		e.log.LogAttrs(ctx, slog.LevelDebug, "workflow done", slog.String("flow", flow),
			slog.Duration("duration", res.Duration))
	}
	return res, err
}
