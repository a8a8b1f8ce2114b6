package master

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/proxy"
)

// routeTTL bounds how long a resolved target is reused. Verbs that move a
// sandbox (pause, resume, kill) drop its entry at once; the TTL only
// matters for changes the master did not make.
const routeTTL = 30 * time.Second

type routeCache struct {
	mu  sync.Mutex
	m   map[string]routeEntry
	hub *routeHub // proxy replicas watching for changes
	// share, on a shared catalog, takes the changes to record for the
	// other master replicas (replicas.go); nil otherwise.
	share chan string
}

type routeEntry struct {
	t       *proxy.Target
	expires time.Time
}

func newRouteCache() *routeCache { return &routeCache{m: map[string]routeEntry{}, hub: newRouteHub()} }

func (c *routeCache) get(id string) *proxy.Target {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.m[id]
	if !ok || time.Now().After(e.expires) {
		delete(c.m, id)
		return nil
	}
	return e.t
}

func (c *routeCache) put(id string, t *proxy.Target) {
	c.mu.Lock()
	c.m[id] = routeEntry{t: t, expires: time.Now().Add(routeTTL)}
	c.mu.Unlock()
}

// drop forgets a route here and in every watching proxy. Verbs call it
// before they act and again once the catalog records the new state, so a
// proxy that resolved in between does not keep the old answer.
func (c *routeCache) drop(id string) {
	c.dropLocal(id, false)
	if c.share != nil {
		select {
		case c.share <- id:
		default: // the writer is behind: the others' TTL covers it
		}
	}
}

// quiesce is drop for a sandbox about to freeze for a move: the watching
// proxies also report what they have open to it (quiesce.go).
func (c *routeCache) quiesce(id string) {
	c.dropLocal(id, true)
	if c.share != nil {
		select {
		case c.share <- id:
		default: // the writer is behind: the others' TTL covers it
		}
	}
}

// dropLocal is drop for a change another replica made (and recorded);
// quiesce as in RouteChange.
func (c *routeCache) dropLocal(id string, quiesce bool) {
	c.mu.Lock()
	delete(c.m, id)
	c.mu.Unlock()
	c.hub.publish(id, quiesce)
}

var (
	_ proxy.Resolver  = (*Service)(nil)
	_ proxy.Forgetter = (*Service)(nil)
)

// Forget implements proxy.Forgetter: this replica's route cache drops
// id (only here: the change, if any, is another's to publish).
func (s *Service) Forget(id string) {
	s.routes.mu.Lock()
	delete(s.routes.m, id)
	s.routes.mu.Unlock()
}

// Resolve implements proxy.Resolver: where a running sandbox can be
// reached. One that is not running (paused, failed) is Unavailable: the
// route answers 502, the status E2B's SDKs read as "not running"
// (cubeproxy's ResolveRoute resumes an autoResume sandbox instead).
func (s *Service) Resolve(ctx context.Context, id string) (*proxy.Target, error) {
	if t := s.routes.get(id); t != nil {
		return t, nil
	}
	// Moving to another node (paused for it, or still being paused for
	// a drain): routeRead waits for the move rather than send a new
	// connection to the copy about to be frozen and destroyed.
	sb, err := s.routeRead(ctx, id, s.cat.GetSandbox)
	if err != nil {
		return nil, err
	}
	switch sb.State {
	case catalog.StateRunning:
	case catalog.StatePaused:
		return nil, fmt.Errorf("sandbox %s is paused; connect to it to resume it: %w", id, errdefs.ErrUnavailable)
	default:
		return nil, fmt.Errorf("sandbox %s is %s: %w", id, sb.State, errdefs.ErrUnavailable)
	}
	t, err := s.targetFor(ctx, sb)
	if err != nil {
		return nil, err
	}
	s.routes.put(id, t)
	return t, nil
}

// targetFor asks the sandbox's node where it is, whatever its state.
func (s *Service) targetFor(ctx context.Context, sb *catalog.Sandbox) (*proxy.Target, error) {
	c, err := s.client(sb.NodeID)
	if err != nil {
		return nil, err
	}
	resp, err := c.GetSandbox(ctx, &cubeletpb.GetSandboxRequest{SandboxId: sb.ID})
	if err != nil {
		return nil, fromGRPC(sb.NodeID, err)
	}
	return s.target(sb, resp.Sandbox), nil
}

func (s *Service) target(sb *catalog.Sandbox, pb *cubeletpb.Sandbox) *proxy.Target {
	t := &proxy.Target{SandboxID: sb.ID, NodeID: sb.NodeID, NodeAddr: s.dataAddress(sb.NodeID)}
	// A slot address means something only on its node's machine (slot
	// plans are node-local and may overlap): without the node's data
	// listener a sandbox elsewhere is unreachable rather than misrouted.
	if s.isLocal(sb.NodeID) {
		t.HostIP = pb.GetNetwork().GetHostIp()
		if pb.Pid > 0 {
			t.NetNS = fmt.Sprintf("/proc/%d/ns/net", pb.Pid)
		}
	}
	if n := sb.Network.AllowPublicTraffic; n != nil && !*n {
		t.TrafficAccessToken = sb.TrafficAccessToken
	}
	return t
}

// agentClient talks HTTP to the cube-agent (envd) in sandboxes, through
// the same dialer as the route: its transport's host is the sandbox ID.
type agentClient struct {
	s *Service
}

type agentTargetKey struct{}

func newAgentClient(s *Service) *agentClient { return &agentClient{s: s} }

// client is a client for one call, and closes the connections it dialed.
// No pooling: every call may be for a sandbox whose network namespace was
// just created or restored. Yet the request does not ask the agent to
// close ("Connection: close"): this side closes once the answer is read.
// Had the agent closed first, its end would sit in TIME_WAIT inside the
// sandbox for a minute, and a gVisor sandbox cannot save such an
// endpoint: a memory snapshot in that minute (a fork right after a
// create) would fail and take the sandbox down.
func (a *agentClient) client() (*http.Client, func()) {
	var mu sync.Mutex
	var conns []net.Conn
	tr := &http.Transport{
		Proxy: nil,
		DialContext: func(ctx context.Context, _, addr string) (net.Conn, error) {
			t, ok := ctx.Value(agentTargetKey{}).(*proxy.Target)
			if !ok {
				return nil, fmt.Errorf("agent call without a target: %w", errdefs.ErrInternal)
			}
			_, ps, _ := net.SplitHostPort(addr)
			port, _ := strconv.Atoi(ps)
			c, err := a.s.dialer.DialSandbox(ctx, t, port)
			if err == nil {
				mu.Lock()
				conns = append(conns, c)
				mu.Unlock()
			}
			return c, err
		},
	}
	done := func() {
		tr.CloseIdleConnections()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	}
	return &http.Client{Transport: tr, Timeout: 15 * time.Second}, done
}

// do sends one request to the agent of t. token, when set, goes in
// X-Access-Token.
func (a *agentClient) do(ctx context.Context, t *proxy.Target, method, path, token string, body any, out any) (int, error) {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return 0, err
		}
		rd = bytes.NewReader(b)
	}
	ctx = context.WithValue(ctx, agentTargetKey{}, t)
	req, err := http.NewRequestWithContext(ctx, method, "http://"+net.JoinHostPort(t.SandboxID, strconv.Itoa(agentproto.Port))+path, rd)
	if err != nil {
		return 0, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if token != "" {
		req.Header.Set("X-Access-Token", token)
	}
	hc, done := a.client()
	// Deferred before the body's Close, so it runs after it: the answer
	// is read, and this side closes the connection.
	defer done()
	resp, err := hc.Do(req)
	if err != nil {
		return 0, fmt.Errorf("agent of %s: %v: %w", t.SandboxID, err, errdefs.ErrUnavailable)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode/100 != 2 {
		return resp.StatusCode, fmt.Errorf("agent of %s: %s %s: %s: %s", t.SandboxID, method, path, resp.Status, bytes.TrimSpace(data))
	}
	if out != nil && len(data) > 0 {
		if err := json.Unmarshal(data, out); err != nil {
			return resp.StatusCode, fmt.Errorf("agent of %s: %s: %w", t.SandboxID, path, err)
		}
	}
	return resp.StatusCode, nil
}

// agentInit is envd's POST /init body.
type agentInit struct {
	EnvVars   map[string]string `json:"envVars,omitempty"`
	Timestamp *time.Time        `json:"timestamp,omitempty"`
}

// initAgent reads the agent's envd version and hands it the sandbox's
// environment. The node started the agent with the sandbox's access
// token (clones too: their reinit gave them their own), so every call
// carries it.
func (s *Service) initAgent(ctx context.Context, sb *catalog.Sandbox, pb *cubeletpb.Sandbox, env map[string]string) error {
	t := s.target(sb, pb)
	tok := sb.EnvdAccessToken
	var info agentproto.Info
	code, err := s.agents.do(ctx, t, http.MethodGet, agentproto.PathInfo, tok, nil, &info)
	switch {
	case err == nil && versionRE.MatchString(info.EnvdVersion):
		sb.EnvdVersion = info.EnvdVersion
	case code == http.StatusNotFound || err == nil:
		sb.EnvdVersion = s.cfg.Sandbox.EnvdVersion // an agent without the endpoint
	default:
		return err
	}
	if len(env) == 0 {
		return nil
	}
	now := time.Now().UTC()
	req := agentInit{EnvVars: env, Timestamp: &now}
	if _, err := s.agents.do(ctx, t, http.MethodPost, "/init", tok, req, nil); err != nil {
		return fmt.Errorf("initialise agent: %w", err)
	}
	return nil
}

// AgentHTTP is an HTTP client to the agent of a running sandbox of the
// caller's team, its base URL and the envd access token to send, for a
// long-lived call (the console's terminal): no timeout; done closes its
// connections.
func (s *Service) AgentHTTP(ctx context.Context, id string) (hc *http.Client, base, token string, done func(), err error) {
	sb, err := s.Get(ctx, id)
	if err != nil {
		return nil, "", "", nil, err
	}
	if sb.State != catalog.StateRunning {
		return nil, "", "", nil, fmt.Errorf("sandbox %s is %s: %w", id, sb.State, errdefs.ErrFailedPrecondition)
	}
	t, err := s.Resolve(ctx, id)
	if err != nil {
		return nil, "", "", nil, err
	}
	c, done := s.agents.client()
	rt := c.Transport
	c.Timeout = 0
	c.Transport = roundTripFunc(func(r *http.Request) (*http.Response, error) {
		return rt.RoundTrip(r.WithContext(context.WithValue(r.Context(), agentTargetKey{}, t)))
	})
	return c, "http://" + net.JoinHostPort(id, strconv.Itoa(agentproto.Port)), sb.EnvdAccessToken, done, nil
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }
