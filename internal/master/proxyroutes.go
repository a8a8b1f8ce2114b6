package master

import (
	"context"
	"crypto/subtle"
	"fmt"
	"sync"
	"time"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// This file is the master's side of cubeproxy: where a sandbox
// is for a proxy replica (resuming sandboxes created with autoResume), and
// a hub that tells every replica's route cache when a route changes.

// RouteInfo is where a running sandbox can be reached, in terms any proxy
// can use: a host IP, or a PID whose network namespace a proxy on the same
// machine (boot ID and PID namespace) can enter.
type RouteInfo struct {
	SandboxID, NodeID   string
	HostIP              string
	PID                 int64
	NodeBootID, NodePID string // the node's machine and PID namespace
	TrafficAccessToken  string // required on proxied traffic when set
	Resumed             bool   // this call resumed the sandbox
	// NodeDataAddr is the node's data listener (nodetunnel); when set,
	// proxies reach the sandbox only through it.
	NodeDataAddr string
}

// Presented is what a proxied client showed: the port it asked for and
// its tokens. It is checked before a paused sandbox is resumed for it.
type Presented struct {
	Port         int
	TrafficToken string // E2b-Traffic-Access-Token: the sandbox's own ports
	EnvdToken    string // X-Access-Token: envd's port
}

// mayResume says whether p may wake sb: the token that would guard the
// request once the sandbox runs must be right already, or a caller
// without it could resume (and keep running) any private sandbox.
func (p Presented) mayResume(sb *catalog.Sandbox) error {
	if p.Port == agentproto.Port {
		if sb.EnvdAccessToken != "" && subtle.ConstantTimeCompare([]byte(p.EnvdToken), []byte(sb.EnvdAccessToken)) != 1 {
			return fmt.Errorf("sandbox %s is paused; resuming it for envd's port needs its access token (X-Access-Token): %w", sb.ID, errdefs.ErrUnauthenticated)
		}
		return nil
	}
	if sb.TrafficAccessToken != "" && subtle.ConstantTimeCompare([]byte(p.TrafficToken), []byte(sb.TrafficAccessToken)) != 1 {
		return fmt.Errorf("sandbox %s is paused; resuming it needs its traffic access token (E2b-Traffic-Access-Token): %w", sb.ID, errdefs.ErrUnauthenticated)
	}
	return nil
}

// ResolveRoute says where a sandbox is. A paused one is resumed first
// (with sandbox.default_timeout as its new deadline) when resume is set and
// it was created with autoResume; otherwise it is FailedPrecondition, which
// proxies answer 409. Concurrent calls for one sandbox resume it once: the
// verb lock serialises them and the later ones find it running.
//
// Before resuming, what the client presented (p) is checked as the route
// would check it once the sandbox runs: a wrong or missing token is
// Unauthenticated and the sandbox stays paused.
func (s *Service) ResolveRoute(ctx context.Context, id string, resume bool, p Presented) (*RouteInfo, error) {
	// Moving to another node (a drain, a resume elsewhere; paused for it
	// or still being paused), by this replica or another: routeRead
	// waits for the move and routes to where it runs now.
	sb, err := s.routeRead(ctx, id, s.Get)
	if err != nil {
		return nil, err
	}
	resumed := false
	if sb.State == catalog.StatePaused {
		if !resume || !sb.AutoResume {
			// Unavailable, which the route answers 502: the status E2B's
			// SDKs read as "not running" (isRunning() is false for it,
			// and throws on anything else).
			return nil, fmt.Errorf("sandbox %s is paused and was not created with autoResume; resume or connect to it first: %w", id, errdefs.ErrUnavailable)
		}
		if err := p.mayResume(sb); err != nil {
			return nil, err
		}
		if sb, resumed, err = s.Connect(ctx, id, 0); err != nil {
			return nil, fmt.Errorf("auto-resume %s: %w", id, err)
		}
		if resumed {
			s.event(id, "info", "sandbox auto-resumed by proxied traffic", nil)
			s.log.Info("sandbox auto-resumed by proxied traffic", "sandbox_id", id)
		}
	}
	if sb.State != catalog.StateRunning {
		return nil, fmt.Errorf("sandbox %s is %s: %w", id, sb.State, errdefs.ErrFailedPrecondition)
	}
	c, err := s.client(sb.NodeID)
	if err != nil {
		return nil, err
	}
	resp, err := c.GetSandbox(ctx, &cubeletpb.GetSandboxRequest{SandboxId: id})
	if err != nil {
		return nil, fromGRPC(sb.NodeID, err)
	}
	t := s.target(sb, resp.Sandbox)
	ri := &RouteInfo{
		// The node's own view: the route replica decides from the
		// node's boot ID and PID namespace whether it may use it.
		SandboxID: id, NodeID: sb.NodeID, HostIP: resp.Sandbox.GetNetwork().GetHostIp(), PID: int64(resp.Sandbox.Pid),
		TrafficAccessToken: t.TrafficAccessToken, Resumed: resumed, NodeDataAddr: t.NodeAddr,
	}
	s.reg.mu.Lock()
	if ns := s.reg.nodes[sb.NodeID]; ns != nil && ns.report != nil {
		ri.NodeBootID, ri.NodePID = ns.report.BootId, ns.report.PidNamespace
	}
	s.reg.mu.Unlock()
	return ri, nil
}

// routeRead reads sandbox id's row (get) for a route once no move of it
// is under way: a move by this replica holds the sandbox's verb lock,
// one by another replica its move's lease in the catalog (awaitMove).
// The wait is bounded by routeMoveWait; past it the error is Aborted,
// which the route answers 503 with Retry-After.
func (s *Service) routeRead(ctx context.Context, id string, get func(context.Context, string) (*catalog.Sandbox, error)) (*catalog.Sandbox, error) {
	sb, err := get(ctx, id)
	if err != nil {
		return nil, err
	}
	if _, moving := s.moving.Load(id); moving {
		lctx, cancel := context.WithTimeout(ctx, routeMoveWait)
		unlock, err := s.locks.lock(lctx, id)
		cancel()
		if err != nil {
			if ctx.Err() == nil {
				return nil, fmt.Errorf("sandbox %s is being moved to another node and still was after %s; try again: %w", id, routeMoveWait, errdefs.ErrAborted)
			}
			return nil, err
		}
		unlock()
		return get(ctx, id)
	}
	waited, err := s.awaitMove(ctx, id, routeMoveWait, errdefs.ErrAborted)
	if err != nil {
		return nil, err
	}
	if waited {
		return get(ctx, id)
	}
	return sb, nil
}

// routeHub fans route invalidations out to watchers (proxy replicas).
// A watcher that falls behind is dropped with its channel closed: it must
// reconnect and start from a reset, as after any disconnect.
type routeHub struct {
	mu   sync.Mutex
	subs map[chan RouteChange]string // -> the watching proxy's ID ("" unnamed)
}

// RouteChange is one event of WatchRoutes: the sandbox's route changed;
// with Quiesce, the sandbox is about to freeze for a move and the proxy
// reports what it has open to it now and once nothing is (quiesce.go).
type RouteChange struct {
	SandboxID string
	Quiesce   bool
}

func newRouteHub() *routeHub { return &routeHub{subs: map[chan RouteChange]string{}} }

func (h *routeHub) publish(id string, quiesce bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for ch := range h.subs {
		select {
		case ch <- RouteChange{SandboxID: id, Quiesce: quiesce}:
		default:
			delete(h.subs, ch)
			close(ch)
		}
	}
}

// watchers are the named proxies watching now.
func (h *routeHub) watchers() map[string]bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := map[string]bool{}
	for _, p := range h.subs {
		if p != "" {
			out[p] = true
		}
	}
	return out
}

// WatchRoutes calls fn with every change of a sandbox's route (paused,
// resumed, killed, moved, quiesced for a move) until ctx ends or fn
// fails. proxyID names the watcher (its activity reports' proxy ID): a
// quiesce waits for its acknowledgement. It returns errdefs.ErrAborted
// when the watcher fell behind and must start again.
func (s *Service) WatchRoutes(ctx context.Context, proxyID string, fn func(RouteChange) error) error {
	ch := make(chan RouteChange, 1024)
	h := s.routes.hub
	h.mu.Lock()
	h.subs[ch] = proxyID
	h.mu.Unlock()
	defer func() {
		h.mu.Lock()
		if _, ok := h.subs[ch]; ok {
			delete(h.subs, ch)
			close(ch)
		}
		h.mu.Unlock()
	}()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-s.ctx.Done():
			return fmt.Errorf("master shutting down: %w", errdefs.ErrUnavailable)
		case c, ok := <-ch:
			if !ok {
				return fmt.Errorf("route watcher fell behind: %w", errdefs.ErrAborted)
			}
			if err := fn(c); err != nil {
				return err
			}
		}
	}
}

// Activity is one proxy's view of one sandbox's traffic.
type Activity struct {
	SandboxID string
	InFlight  int   // requests and streams open now
	Requests  int64 // since the last report
	// Quiesced: the proxy had a quiesce event for the sandbox and
	// dropped its route before counting InFlight.
	Quiesced bool
}

// activity is what the idle policy knows: when each sandbox last saw
// traffic (API verbs or proxied requests) and how many requests each proxy
// holds open. It lives in memory: a restarted master gives every sandbox a
// full idle period again, which errs on the side of keeping it running.
type activity struct {
	mu   sync.Mutex
	last map[string]time.Time
	open map[string]map[string]openCount // sandbox -> proxy -> count
	// On a shared catalog: the sandboxes whose traffic changed since it
	// was last written for the other replicas, and what the other
	// replicas wrote (replicas.go).
	dirty  map[string]bool
	remote map[string]remoteActivity
	// changed is closed (and replaced) by every report: a quiesce
	// waits on it (quiesce.go). flush asks flushActivity (a shared
	// catalog) to write now rather than at its next tick.
	changed chan struct{}
	flush   chan struct{}
	// quiescing: sandboxes another replica is quiescing, whose traffic
	// row this replica writes (with the move's lease token, its answer)
	// only once its watching proxies have answered (quiesce.go).
	quiescing map[string]*quiesceAnswer
}

// remoteActivity is the other replicas' traffic for one sandbox.
type remoteActivity struct {
	last time.Time
	busy bool // a replica had requests open when it last wrote
}

type openCount struct {
	n  int
	at time.Time
	// quiesced is when the proxy last reported the sandbox quiesced
	// (RouteChange.Quiesce answered).
	quiesced time.Time
}

// openStale is how long an open count from a proxy that stopped reporting
// keeps a sandbox awake.
const openStale = 15 * time.Second

func newActivity() *activity {
	return &activity{last: map[string]time.Time{}, open: map[string]map[string]openCount{}, dirty: map[string]bool{},
		remote: map[string]remoteActivity{}, changed: make(chan struct{}), flush: make(chan struct{}, 1),
		quiescing: map[string]*quiesceAnswer{}}
}

// kickFlush has flushActivity write the dirty sandboxes now.
func (a *activity) kickFlush() {
	select {
	case a.flush <- struct{}{}:
	default:
	}
}

func (a *activity) touch(id string, now time.Time) {
	a.mu.Lock()
	a.last[id] = now
	a.dirty[id] = true
	a.mu.Unlock()
}

// idleSince is when the sandbox was last active, or ok=false when it is
// busy now. A sandbox never seen counts as active now.
func (a *activity) idleSince(id string, now time.Time) (time.Time, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for p, c := range a.open[id] {
		if now.Sub(c.at) > openStale {
			delete(a.open[id], p)
			continue
		}
		if c.n > 0 {
			return time.Time{}, false
		}
	}
	r := a.remote[id]
	if r.busy {
		return time.Time{}, false
	}
	t, ok := a.last[id]
	if !ok {
		a.last[id] = now
		t = now
	}
	if r.last.After(t) {
		t = r.last
	}
	return t, true
}

func (a *activity) forget(id string) {
	a.mu.Lock()
	delete(a.last, id)
	delete(a.open, id)
	delete(a.dirty, id)
	delete(a.remote, id)
	delete(a.quiescing, id)
	a.mu.Unlock()
}

// ReportActivity records what a proxy replica saw since its last report.
func (s *Service) ReportActivity(_ context.Context, proxyID string, acts []Activity) error {
	if proxyID == "" {
		return errdefs.FieldErrorf("proxy_id", "is required")
	}
	for _, act := range acts {
		if act.InFlight < 0 || act.Requests < 0 {
			return errdefs.FieldErrorf("sandboxes", "negative counts for %s", act.SandboxID)
		}
	}
	now := time.Now()
	a := s.activity
	a.mu.Lock()
	quiesced := false
	for _, act := range acts {
		if act.Requests > 0 || act.InFlight > 0 {
			a.last[act.SandboxID] = now
		}
		prev := a.open[act.SandboxID][proxyID]
		if act.Requests > 0 || act.InFlight > 0 || prev.n > 0 || act.Quiesced {
			a.dirty[act.SandboxID] = true
		}
		m := a.open[act.SandboxID]
		if m == nil {
			m = map[string]openCount{}
			a.open[act.SandboxID] = m
		}
		c := openCount{n: act.InFlight, at: now, quiesced: prev.quiesced}
		if act.Quiesced {
			c.quiesced, quiesced = now, true
		}
		m[proxyID] = c
	}
	close(a.changed)
	a.changed = make(chan struct{})
	a.mu.Unlock()
	if quiesced {
		// Another replica's move may wait on what this replica's
		// proxies have open (quiesce.go): it is written now.
		s.activity.kickFlush()
	}
	return nil
}

// idleLoop pauses running sandboxes that have an idle timeout and have had
// no traffic and nothing open for that long.
func (s *Service) idleLoop(ctx context.Context) {
	tick := time.NewTicker(s.cfg.Sandbox.ExpiryInterval.Duration)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		if s.shared() {
			s.loadActivity(ctx)
		}
		sbs, err := s.cat.WithIdleTimeout(ctx)
		if err != nil {
			if ctx.Err() == nil {
				s.log.Error("idle: list sandboxes", "err", err)
			}
			continue
		}
		now := time.Now()
		for _, sb := range sbs {
			if sb.IdleTimeout <= 0 {
				continue
			}
			since, idle := s.activity.idleSince(sb.ID, now)
			if !idle || now.Sub(since) < sb.IdleTimeout {
				continue
			}
			if err := s.pauseIdle(ctx, sb.ID); err != nil && ctx.Err() == nil {
				s.log.Warn("idle pause failed; will retry", "sandbox_id", sb.ID, "err", err)
			}
		}
	}
}

func (s *Service) pauseIdle(ctx context.Context, id string) error {
	unlock, err := s.locks.lock(ctx, id)
	if err != nil {
		return err
	}
	defer unlock()
	// Moving (by another replica): not idle, whatever its traffic says.
	if waited, err := s.awaitMove(ctx, id, 0, errdefs.ErrUnavailable); waited || err != nil {
		return nil
	}
	sb, err := s.Get(ctx, id)
	if errdefs.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	// Re-check under the lock: a request may have arrived meanwhile.
	since, idle := s.activity.idleSince(id, time.Now())
	if sb.State != catalog.StateRunning || !idle || time.Since(since) < sb.IdleTimeout {
		return nil
	}
	if err := s.fence(ctx); err != nil {
		return err
	}
	if err := s.pause(ctx, sb); err != nil {
		return err
	}
	s.activity.forget(id)
	s.event(id, "info", "idle: sandbox paused", map[string]string{"idle_timeout": sb.IdleTimeout.String()})
	s.log.Info("sandbox paused: idle", "sandbox_id", id, "idle_timeout", sb.IdleTimeout)
	return nil
}

// PerIDState is how many sandbox IDs the master's in-memory route state
// holds: activity entries (last traffic, open counts) and cached routes.
// Only admitted traffic and known sandboxes add to it; tests bound it
// under a flood of unknown IDs.
func (s *Service) PerIDState() (activity, routes int) {
	s.activity.mu.Lock()
	ids := make(map[string]struct{}, len(s.activity.last))
	for id := range s.activity.last {
		ids[id] = struct{}{}
	}
	for id := range s.activity.open {
		ids[id] = struct{}{}
	}
	s.activity.mu.Unlock()
	s.routes.mu.Lock()
	routes = len(s.routes.m)
	s.routes.mu.Unlock()
	return len(ids), routes
}
