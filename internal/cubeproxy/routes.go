package cubeproxy

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/singleflight"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/errdefs/grpcerr"
	"github.com/cubesandbox/cube/internal/proxy"
)

// Routes is a proxy.Resolver backed by the master's RouteService: a cache
// of where sandboxes are, emptied entry by entry by the master's
// WatchRoutes stream (a sandbox paused, resumed, killed or moved) and
// wholesale whenever that stream breaks, since changes may have been
// missed. While the stream is down nothing is cached: every request asks
// the master, so a replica never serves a stale route for longer than ttl.
//
// A miss asks the master with resume=true: a paused sandbox created with
// autoResume is resumed and then served. Concurrent misses for one sandbox
// share one call (singleflight), so a burst triggers one resume per
// replica, and the master's per-sandbox lock makes it one per cluster.
type Routes struct {
	client  masterpb.RouteServiceClient
	log     *slog.Logger
	ttl     time.Duration
	self    identity
	metrics *Metrics

	mu      sync.Mutex
	m       map[string]cached
	neg     map[string]time.Time // IDs the master did not know, until when (bounded: maxNegative)
	gen     uint64               // bumped on every invalidation; a resolve started before one is not cached
	watched atomic.Bool
	sf      singleflight.Group
	// onChange, when set, is called (in its own goroutine) with the ID
	// of every sandbox whose route the master says changed.
	onChange func(id string)
	// proxyID names this replica to the master in WatchRoutes, as in
	// its activity reports; onQuiesce, when set, is called (after the
	// route is dropped, before the next event) with the ID of every
	// sandbox the master quiesces for a move.
	proxyID   string
	onQuiesce func(id string)
}

type cached struct {
	t       *proxy.Target
	expires time.Time
}

// identity is this machine and PID namespace: a sandbox on a node with the
// same one can be reached through /proc/<pid>/ns/net.
type identity struct{ bootID, pidNS string }

func selfIdentity() identity {
	var id identity
	if b, err := os.ReadFile("/proc/sys/kernel/random/boot_id"); err == nil {
		id.bootID = strings.TrimSpace(string(b))
	}
	id.pidNS, _ = os.Readlink("/proc/self/ns/pid")
	return id
}

// resolveTimeout bounds one ResolveRoute call, an auto-resume included. It
// does not follow the client's context: the resume other requests wait on
// must not fail because the first client hung up.
const resolveTimeout = 60 * time.Second

// An ID the master answered NotFound is answered so again without asking
// for negativeTTL, under the same rules as a cached route (only while
// watched; dropped by the master's events). At most maxNegative are kept:
// a flood of random IDs costs bounded memory.
const (
	negativeTTL = 5 * time.Second
	maxNegative = 10000
)

var (
	_ proxy.Resolver  = (*Routes)(nil)
	_ proxy.Forgetter = (*Routes)(nil)
)

// Forget implements proxy.Forgetter: a request to id failed on its way,
// and the route asks the master afresh (the sandbox may have moved
// before the master's change reached this replica).
func (r *Routes) Forget(id string) {
	if id != "" {
		r.invalidate(id)
	}
}

// NewRoutes returns a Routes; Watch must run for it to cache.
func NewRoutes(client masterpb.RouteServiceClient, ttl time.Duration, m *Metrics, log *slog.Logger) *Routes {
	if ttl <= 0 {
		ttl = 30 * time.Second
	}
	return &Routes{client: client, log: log, ttl: ttl, self: selfIdentity(), metrics: m, m: map[string]cached{}, neg: map[string]time.Time{}}
}

// Resolve implements proxy.Resolver.
func (r *Routes) Resolve(ctx context.Context, id string) (*proxy.Target, error) {
	r.mu.Lock()
	e, ok := r.m[id]
	negUntil, neg := r.neg[id]
	gen := r.gen
	r.mu.Unlock()
	if ok && time.Now().Before(e.expires) {
		return e.t, nil
	}
	if neg && time.Now().Before(negUntil) {
		return nil, fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	// What the client presented goes with the resolve: the master checks
	// it before resuming a paused sandbox. Concurrent requests share a
	// resolve only when they presented the same, so a caller with a wrong
	// token cannot fail (or succeed) one for another.
	p, _ := proxy.PresentedFrom(ctx)
	key := id + "\x00" + strconv.FormatBool(p.Port == agentproto.Port) + "\x00" + p.TrafficToken + "\x00" + p.EnvdToken
	ch := r.sf.DoChan(key, func() (any, error) {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), resolveTimeout)
		defer cancel()
		resp, err := r.client.ResolveRoute(cctx, &masterpb.ResolveRouteRequest{SandboxId: id, Resume: true,
			Port: int32(p.Port), TrafficAccessToken: p.TrafficToken, EnvdAccessToken: p.EnvdToken})
		if err != nil {
			err = fromGRPC(err)
			if errdefs.IsNotFound(err) {
				r.remember(id, gen)
			}
			return nil, err
		}
		if resp.Resumed {
			r.metrics.resumed(id)
			r.log.Info("sandbox auto-resumed", "sandbox_id", id)
		}
		t := r.target(resp)
		r.mu.Lock()
		if r.watched.Load() && r.gen == gen {
			r.m[id] = cached{t: t, expires: time.Now().Add(r.ttl)}
		}
		r.mu.Unlock()
		return t, nil
	})
	select {
	case res := <-ch:
		if res.Err != nil {
			return nil, res.Err
		}
		return res.Val.(*proxy.Target), nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (r *Routes) target(resp *masterpb.ResolveRouteResponse) *proxy.Target {
	t := &proxy.Target{SandboxID: resp.SandboxId, NodeID: resp.NodeId, TrafficAccessToken: resp.TrafficAccessToken,
		NodeAddr: resp.NodeDataAddress}
	// A slot address means something only on its node's machine: slot
	// plans are node-local and may overlap, so from another machine it
	// could name another node's sandbox. Without the node's data
	// listener, a sandbox elsewhere is unreachable rather than misrouted.
	if resp.NodeBootId != "" && resp.NodeBootId == r.self.bootID && resp.NodePidNamespace == r.self.pidNS {
		t.HostIP = resp.HostIp
		if resp.Pid > 0 {
			t.NetNS = fmt.Sprintf("/proc/%d/ns/net", resp.Pid)
		}
	}
	return t
}

func (r *Routes) invalidate(id string) {
	r.mu.Lock()
	r.gen++
	if id == "" {
		clear(r.m)
		clear(r.neg)
	} else {
		delete(r.m, id)
		delete(r.neg, id)
	}
	r.mu.Unlock()
}

// remember records that the master does not know id (a NotFound from a
// resolve started at generation gen).
func (r *Routes) remember(id string, gen uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.watched.Load() || r.gen != gen {
		return
	}
	if len(r.neg) >= maxNegative {
		now := time.Now()
		for k, until := range r.neg {
			if now.After(until) {
				delete(r.neg, k)
			}
		}
		for k := range r.neg { // still full: drop any one
			if len(r.neg) < maxNegative {
				break
			}
			delete(r.neg, k)
		}
	}
	r.neg[id] = time.Now().Add(negativeTTL)
}

// Cached reports whether a route for id is cached now (a sandbox this
// replica served recently).
func (r *Routes) Cached(id string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	e, ok := r.m[id]
	return ok && time.Now().Before(e.expires)
}

// Negative is the number of IDs remembered as unknown.
func (r *Routes) Negative() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.neg)
}

// Len is the number of cached routes.
func (r *Routes) Len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.m)
}

// Watch follows the master's invalidations until ctx ends, reconnecting
// with backoff. Caching is on only while the stream is up.
func (r *Routes) Watch(ctx context.Context) {
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		err := r.watchOnce(ctx)
		r.watched.Store(false)
		r.invalidate("")
		if ctx.Err() != nil {
			return
		}
		r.log.Warn("route watch broken; not caching until it is back", "err", err, "retry_in", backoff)
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 2*time.Second)
	}
}

func (r *Routes) watchOnce(ctx context.Context) error {
	// WaitForReady: while the master is unreachable the call waits for it
	// instead of failing at once (Resolve calls still fail fast).
	stream, err := r.client.WatchRoutes(ctx, &masterpb.WatchRoutesRequest{ProxyId: r.proxyID}, grpc.WaitForReady(true))
	if err != nil {
		return err
	}
	for {
		ev, err := stream.Recv()
		if err != nil {
			return err
		}
		if ev.Reset_ {
			r.invalidate("")
			r.watched.Store(true)
			continue
		}
		r.invalidate(ev.SandboxId)
		if ev.Quiesce && r.onQuiesce != nil {
			// After the invalidation: what it reports counts every
			// request that may still reach the sandbox where it was.
			r.onQuiesce(ev.SandboxId)
		}
		if r.onChange != nil {
			go r.onChange(ev.SandboxId)
		}
	}
}

// where asks the master where sandbox id is now, resuming nothing: its
// target, or gone when the master does not know it. Neither (nil, false)
// when the master answered otherwise (paused, moving past goneTimeout,
// unreachable).
func (r *Routes) where(ctx context.Context, id string) (t *proxy.Target, gone bool) {
	cctx, cancel := context.WithTimeout(ctx, goneTimeout)
	defer cancel()
	resp, err := r.client.ResolveRoute(cctx, &masterpb.ResolveRouteRequest{SandboxId: id})
	if err != nil {
		return nil, errdefs.IsNotFound(fromGRPC(err))
	}
	return r.target(resp), false
}

// goneTimeout bounds the check where makes.
const goneTimeout = 5 * time.Second

// fromGRPC classifies a master error for proxy.writeError: a status in
// the project's error vocabulary (grpcerr), anything else (the master
// unreachable before a status) Unavailable.
func fromGRPC(err error) error {
	if _, ok := status.FromError(err); !ok {
		return fmt.Errorf("master: %v: %w", err, errdefs.ErrUnavailable)
	}
	err = grpcerr.FromGRPC(err)
	if errdefs.IsCanceled(err) {
		// The call runs on its own context (resolveTimeout): this is the
		// master giving up, not our client leaving, and must be answered.
		return fmt.Errorf("master: %v: %w", err, errdefs.ErrUnavailable)
	}
	return err
}

// Watching reports whether the invalidation stream is up (routes are cached).
func (r *Routes) Watching() bool { return r.watched.Load() }
