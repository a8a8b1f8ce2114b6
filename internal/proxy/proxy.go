// Package proxy is the data-plane route: it takes HTTP requests meant for a
// port of a sandbox and passes them through to it. It is the seed of
// cubeproxy; today cubemaster runs it in-process.
//
// A request names its sandbox and port in one of two ways, as the E2B SDKs
// do:
//
//   - the headers E2b-Sandbox-Id and E2b-Sandbox-Port (what the SDK sends
//     when E2B_SANDBOX_URL points every sandbox at one URL), or
//   - the Host <port>-<sandboxID>.<domain> (the SDK's default, and what
//     sandbox.getHost(port) returns).
//
// The Resolver says where the sandbox is (a Target); the Dialer opens the
// connection. Both are interfaces so that cubeproxy can bring a route cache
// fed by the master and its own dialer. Bodies stream in both directions
// (FlushInterval -1): Connect server streams and long downloads are never
// buffered, and an HTTP/1.1 exchange is full duplex: the answer streams
// back while the request body is still coming in. HTTP/1.1 (including
// WebSocket upgrades) goes out as HTTP/1.1;
// HTTP/2 cleartext (h2c) comes in and goes out as h2c.
package proxy

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/nodetunnel"
	"github.com/cubesandbox/cube/internal/nsdial"
	"github.com/cubesandbox/cube/internal/sandboxid"
)

// Headers the E2B SDKs send to name the sandbox and port.
const (
	HeaderSandboxID    = "E2b-Sandbox-Id"
	HeaderSandboxPort  = "E2b-Sandbox-Port"
	HeaderTrafficToken = "E2b-Traffic-Access-Token"
)

// Target is where a sandbox can be reached.
type Target struct {
	SandboxID string
	NodeID    string
	// HostIP is the sandbox's address as the node sees it (a network-agent
	// slot): the proxy dials HostIP:port. Empty when the sandbox has none.
	HostIP string
	// NetNS is the sandbox's network namespace on this machine
	// (/proc/<pid>/ns/net): without a HostIP, the proxy dials
	// 127.0.0.1:port inside it. Empty when the sandbox is on another machine.
	NetNS string
	// TrafficAccessToken, when set, must come with every request to the
	// sandbox's ports (all but envd's) in the E2b-Traffic-Access-Token header.
	TrafficAccessToken string
	// NodeAddr is the node data listener of the sandbox's node
	// (package nodetunnel). When set, the sandbox is reached through it
	// and never at HostIP or NetNS: slot addresses are node-local, and
	// the same HostIP here may be another node's (or no) sandbox.
	NodeAddr string
}

// Resolver finds where a sandbox is. Its errors use errdefs: NotFound (no
// such sandbox), Unavailable (not running: paused, failed; or its node
// cannot be reached from here), each answered 502 as E2B's proxy does.
type Resolver interface {
	Resolve(ctx context.Context, sandboxID string) (*Target, error)
}

// Dialer opens a TCP connection to a port of a sandbox.
type Dialer interface {
	DialSandbox(ctx context.Context, t *Target, port int) (net.Conn, error)
}

// NetDialer is the default Dialer: the node data listener when the
// sandbox's node serves one, else the sandbox's host IP when it has one,
// else its network namespace when it is on this machine.
type NetDialer struct {
	Timeout time.Duration // per connection attempt; 10 s when zero
	// Tunnel dials node data listeners (this component's cluster
	// certificate); without it a sandbox whose node serves one is
	// unreachable from here.
	Tunnel *nodetunnel.Dialer
}

// DialSandbox implements Dialer.
func (d NetDialer) DialSandbox(ctx context.Context, t *Target, port int) (net.Conn, error) {
	timeout := d.Timeout
	if timeout == 0 {
		timeout = 10 * time.Second
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	switch {
	case t.NodeAddr != "":
		if d.Tunnel == nil {
			return nil, fmt.Errorf("sandbox %s: node %s serves it at %s, and this component has no cluster certificate to call it with: %w",
				t.SandboxID, t.NodeID, t.NodeAddr, errdefs.ErrUnavailable)
		}
		return d.Tunnel.Dial(ctx, t.NodeAddr, t.NodeID, t.SandboxID, port)
	case t.HostIP != "":
		var nd net.Dialer
		return nd.DialContext(ctx, "tcp", net.JoinHostPort(t.HostIP, strconv.Itoa(port)))
	case t.NetNS != "":
		return nsdial.DialContext(ctx, t.NetNS, "tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	}
	return nil, fmt.Errorf("sandbox %s on node %s has no address reachable from here: %w", t.SandboxID, t.NodeID, errdefs.ErrUnavailable)
}

// Config configures a Handler.
type Config struct {
	Resolver Resolver
	Dialer   Dialer // NetDialer{} when nil
	// Domain is the suffix of <port>-<sandboxID>.<domain> hosts.
	Domain string
	Log    *slog.Logger
	// NoRetry turns off the one retry of a failed request on the
	// sandbox's new location (retryTransport): its failure is answered
	// 502 at once, as a route without moves would.
	NoRetry bool
}

// Forgetter is a Resolver that caches: Forget drops what it holds for a
// sandbox, so that the next Resolve asks afresh. A request that failed
// on its way to a sandbox forgets its route before resolving it again.
type Forgetter interface {
	Forget(sandboxID string)
}

// RetryAfter is the Retry-After (seconds) of a 503 answered for a sandbox
// that is moving to another node and was not there in time.
const RetryAfter = "2"

// Handler is the route, an http.Handler.
type Handler struct {
	cfg    Config
	log    *slog.Logger
	h1, h2 *http.Transport
	rp     *httputil.ReverseProxy

	mu       sync.Mutex
	inflight map[string]map[*inflightReq]struct{} // by sandbox ID
	// samePlace: sandboxes a failed request's resolve found where they
	// were, and when (retryTransport).
	samePlace map[string]time.Time
}

// inflightReq is one request on its way to a sandbox, to be ended by
// Abort, and its current attempt (retryTransport), to be ended by Moved.
type inflightReq struct {
	cancel context.CancelCauseFunc

	mu      sync.Mutex
	at      *Target                 // where the current attempt goes
	attempt context.CancelCauseFunc // ends the current attempt only
}

// setAttempt records the attempt under way.
func (r *inflightReq) setAttempt(at *Target, cancel context.CancelCauseFunc) {
	r.mu.Lock()
	r.at, r.attempt = at, cancel
	r.mu.Unlock()
}

// movedTo ends the current attempt when it goes elsewhere than to.
func (r *inflightReq) movedTo(to *Target) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.attempt == nil || r.at == nil || sameLocation(r.at, to) {
		return false
	}
	r.attempt(errMoved)
	r.attempt = nil
	return true
}

// errMoved ends an attempt to reach a sandbox where it no longer is.
var errMoved = fmt.Errorf("the sandbox moved to another node: %w", errdefs.ErrUnavailable)

// Moved ends the attempts under way to sandboxID that go elsewhere than
// to, where the sandbox is now, and returns how many it ended. Each such
// request is then sent to to when it may be sent again (retryTransport),
// else answered 502. A sandbox frozen for a move, then destroyed, may
// never close the connections it had (gVisor's network stack goes with
// it): without Moved such a request hung until its client gave up.
func (h *Handler) Moved(sandboxID string, to *Target) int {
	h.mu.Lock()
	var reqs []*inflightReq
	for r := range h.inflight[sandboxID] {
		reqs = append(reqs, r)
	}
	h.mu.Unlock()
	n := 0
	for _, r := range reqs {
		if r.movedTo(to) {
			n++
		}
	}
	return n
}

// InFlight reports whether a request to sandboxID is under way.
func (h *Handler) InFlight(sandboxID string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.inflight[sandboxID]) > 0
}

// Abort ends every request under way to sandboxID with cause (which
// should carry an errdefs kind: a gone sandbox is NotFound, answered 502
// when no answer has started) and returns how many it ended. A sandbox
// whose network stack vanished with it (gVisor's, in its own process)
// never closes the connections it had: without Abort, a request waiting
// for its answer hung until the client gave up.
func (h *Handler) Abort(sandboxID string, cause error) int {
	h.mu.Lock()
	reqs := h.inflight[sandboxID]
	delete(h.inflight, sandboxID)
	h.mu.Unlock()
	for r := range reqs {
		r.cancel(cause)
	}
	return len(reqs)
}

// track registers a request to sandboxID and returns its context (ended
// by Abort), its entry, and the function that unregisters it.
func (h *Handler) track(ctx context.Context, sandboxID string) (context.Context, *inflightReq, func()) {
	ctx, cancel := context.WithCancelCause(ctx)
	r := &inflightReq{cancel: cancel}
	h.mu.Lock()
	if h.inflight == nil {
		h.inflight = map[string]map[*inflightReq]struct{}{}
	}
	if h.inflight[sandboxID] == nil {
		h.inflight[sandboxID] = map[*inflightReq]struct{}{}
	}
	h.inflight[sandboxID][r] = struct{}{}
	h.mu.Unlock()
	return ctx, r, func() {
		h.mu.Lock()
		if m := h.inflight[sandboxID]; m != nil {
			delete(m, r)
			if len(m) == 0 {
				delete(h.inflight, sandboxID)
			}
		}
		h.mu.Unlock()
		cancel(nil)
	}
}

type ctxKey struct{}

type admittedKey struct{}

type presentedKey struct{}

type unresolvedKey struct{}

// WithUnresolved returns ctx carrying fn, which ServeHTTP calls (in its
// own goroutine) when the request's sandbox did not resolve, with the
// Resolver's error: a wrapper can limit what a client may cost by asking
// for sandboxes that do not exist.
func WithUnresolved(ctx context.Context, fn func(error)) context.Context {
	return context.WithValue(ctx, unresolvedKey{}, fn)
}

// HeaderEnvdToken is envd's access token header (checked by the agent).
const HeaderEnvdToken = "X-Access-Token"

// Presented is what a request showed for its sandbox: the port and the
// tokens. ServeHTTP hands it to the Resolver in the context, so one that
// would resume a paused sandbox can check the tokens first.
type Presented struct {
	Port                    int
	TrafficToken, EnvdToken string
}

// PresentedFrom returns what the request being resolved presented; false
// outside ServeHTTP.
func PresentedFrom(ctx context.Context) (Presented, bool) {
	p, ok := ctx.Value(presentedKey{}).(Presented)
	return p, ok
}

// WithAdmitted returns ctx carrying fn, which ServeHTTP calls (in its own
// goroutine) once the request's sandbox resolved and its token checked,
// right before the request goes to the sandbox. A wrapper keeps per-
// sandbox state (metrics, activity) only for requests it admitted: IDs
// that resolve to nothing, or whose token is wrong, leave none.
func WithAdmitted(ctx context.Context, fn func(*Target)) context.Context {
	return context.WithValue(ctx, admittedKey{}, fn)
}

// routed is what ServeHTTP learned about a request, handed to the
// transport's dialer through the request context.
type routed struct {
	target    *Target
	port      int
	presented Presented
	body      *watchedBody // the request's body; nil without one
	req       *inflightReq
}

// New returns a Handler.
func New(cfg Config) *Handler {
	if cfg.Dialer == nil {
		cfg.Dialer = NetDialer{}
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	h := &Handler{cfg: cfg, log: cfg.Log}
	dial := func(ctx context.Context, _, addr string) (net.Conn, error) {
		// The URL host is "<sandboxID>.<location>:<port>" (upstreamHost),
		// so pooled connections are never shared between sandboxes, ports,
		// or places a sandbox has been: after a move, a connection to
		// where it was is never reused for where it is. The target
		// resolved for the request rides in its context; a dial without
		// it (which the transport does not do today) resolves again.
		host, portStr, err := net.SplitHostPort(addr)
		if err != nil {
			return nil, err
		}
		id, _, _ := strings.Cut(host, ".")
		port, _ := strconv.Atoi(portStr)
		if r, ok := ctx.Value(ctxKey{}).(routed); ok && r.target.SandboxID == id && r.port == port {
			return cfg.Dialer.DialSandbox(ctx, r.target, port)
		}
		t, err := cfg.Resolver.Resolve(ctx, id)
		if err != nil {
			return nil, err
		}
		return cfg.Dialer.DialSandbox(ctx, t, port)
	}
	h.h1 = &http.Transport{
		Proxy: nil, DialContext: dial, ForceAttemptHTTP2: false,
		MaxIdleConnsPerHost: 32, IdleConnTimeout: 90 * time.Second, ResponseHeaderTimeout: 0,
	}
	h.h2 = &http.Transport{Proxy: nil, DialContext: dial, IdleConnTimeout: 90 * time.Second}
	h.h2.Protocols = new(http.Protocols)
	h.h2.Protocols.SetUnencryptedHTTP2(true)
	var tr http.RoundTripper = transportFor{h1: h.h1, h2: h.h2}
	if !cfg.NoRetry {
		tr = retryTransport{h: h, next: tr}
	}
	h.rp = &httputil.ReverseProxy{
		Rewrite:       rewrite,
		Transport:     tr,
		FlushInterval: -1,
		ErrorHandler:  h.proxyError,
		ErrorLog:      slog.NewLogLogger(cfg.Log.Handler(), slog.LevelDebug),
	}
	return h
}

// transportFor sends HTTP/2 requests over h2c and the rest over HTTP/1.1.
type transportFor struct{ h1, h2 *http.Transport }

func (t transportFor) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.ProtoMajor == 2 {
		return t.h2.RoundTrip(r)
	}
	return t.h1.RoundTrip(r)
}

func rewrite(pr *httputil.ProxyRequest) {
	r := pr.In.Context().Value(ctxKey{}).(routed)
	pr.Out.URL.Scheme = "http"
	pr.Out.URL.Host = upstreamHost(r.target, r.port)
	// The service in the sandbox sees the host the client used.
	pr.Out.Host = pr.In.Host
	pr.Out.Header.Del(HeaderTrafficToken)
	pr.SetXForwarded()
}

// Close drops idle upstream connections.
func (h *Handler) Close() {
	h.h1.CloseIdleConnections()
	h.h2.CloseIdleConnections()
}

// ParseHost splits "<port>-<sandboxID>.<domain>[:port]" into sandbox ID and
// port. domain "" accepts any domain.
func ParseHost(host, domain string) (id string, port int, ok bool) {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	label, rest, found := strings.Cut(host, ".")
	if !found {
		return "", 0, false
	}
	if domain != "" {
		if d, _, err := net.SplitHostPort(domain); err == nil {
			domain = d
		}
		if !strings.EqualFold(rest, domain) {
			return "", 0, false
		}
	}
	p, id, found := strings.Cut(label, "-")
	if !found {
		return "", 0, false
	}
	port, err := strconv.Atoi(p)
	if err != nil || port < 1 || port > 65535 || sandboxid.Validate("sandbox", id) != nil {
		return "", 0, false
	}
	return id, port, true
}

// IsAPIHost reports whether host (a port after it is ignored) is
// api.<domain>, where the E2B SDKs configured by E2B_DOMAIN alone send
// their API calls. domain "" matches nothing.
func IsAPIHost(host, domain string) bool {
	if domain == "" {
		return false
	}
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	if d, _, err := net.SplitHostPort(domain); err == nil {
		domain = d
	}
	return strings.EqualFold(host, "api."+domain)
}

// Route says which sandbox and port a request is for, as ServeHTTP routes
// it (cubeproxy labels its metrics and access log with it).
func (h *Handler) Route(r *http.Request) (sandboxID string, port int, err error) { return h.route(r) }

// route finds which sandbox and port a request is for.
func (h *Handler) route(r *http.Request) (string, int, error) {
	if id := r.Header.Get(HeaderSandboxID); id != "" {
		ps := r.Header.Get(HeaderSandboxPort)
		port, err := strconv.Atoi(ps)
		if err != nil || port < 1 || port > 65535 {
			return "", 0, fmt.Errorf("%s %q is not a port: %w", HeaderSandboxPort, ps, errdefs.ErrInvalidArgument)
		}
		if err := sandboxid.Validate("sandbox", id); err != nil {
			return "", 0, err
		}
		return id, port, nil
	}
	if id, port, ok := ParseHost(r.Host, h.cfg.Domain); ok {
		return id, port, nil
	}
	return "", 0, fmt.Errorf("no sandbox in the request: want the %s and %s headers or a <port>-<sandboxID>.%s host: %w",
		HeaderSandboxID, HeaderSandboxPort, h.cfg.Domain, errdefs.ErrInvalidArgument)
}

// ServeHTTP implements http.Handler.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	id, port, err := h.route(r)
	if err != nil {
		writeError(w, "", err)
		return
	}
	if port == agentproto.Port && strings.HasPrefix(r.URL.Path, agentproto.InternalPrefix) {
		writeError(w, id, fmt.Errorf("%s is internal to the node: %w", agentproto.InternalPrefix, errdefs.ErrNotFound))
		return
	}
	presented := Presented{Port: port, TrafficToken: r.Header.Get(HeaderTrafficToken), EnvdToken: r.Header.Get(HeaderEnvdToken)}
	t, err := h.cfg.Resolver.Resolve(context.WithValue(r.Context(), presentedKey{}, presented), id)
	if err != nil {
		if fn, ok := r.Context().Value(unresolvedKey{}).(func(error)); ok {
			fn(err)
		}
		writeError(w, id, err)
		return
	}
	// The traffic token guards the sandbox's own ports; envd's port has its
	// own access token (X-Access-Token, checked by the agent), and the SDKs
	// never send the traffic token there.
	if t.TrafficAccessToken != "" && port != agentproto.Port && !tokenEqual(r.Header.Get(HeaderTrafficToken), t.TrafficAccessToken) {
		writeError(w, id, errUnauthorized)
		return
	}
	if fn, ok := r.Context().Value(admittedKey{}).(func(*Target)); ok {
		fn(t)
	}
	// Full duplex: the answer may start while the request body is still
	// being passed on (a Connect stream's first event can come back before
	// the transport has read the client's body to its end). Without it,
	// Go's HTTP/1.1 server drains and closes the request body when the
	// response headers go out, under the transport that is still reading
	// it; the transport then fails the request write and closes the
	// upstream connection, killing a stream that had begun.
	duplex := r.ProtoMajor == 1 && r.Body != nil && r.Body != http.NoBody && r.Header.Get("Upgrade") == "" &&
		http.NewResponseController(w).EnableFullDuplex() == nil
	ctx, req, untrack := h.track(r.Context(), id)
	defer untrack()
	body := r.Body
	var watched *watchedBody
	if body != nil && body != http.NoBody {
		// Whether any of the body was taken decides whether a failed
		// request may be sent again (retryTransport).
		watched = &watchedBody{rc: body}
	}
	ctx = context.WithValue(ctx, ctxKey{}, routed{target: t, port: port, presented: presented, body: watched, req: req})
	out := r.WithContext(ctx)
	if watched != nil {
		out.Body = watched
	}
	h.rp.ServeHTTP(w, out)
	if duplex {
		// The answer is complete; read what is left of the body (as the
		// server would, up to the same bound) before returning. Left to
		// the server, its end-of-body background read can start after the
		// server stopped waiting for one, and the server then panics
		// reading the next request ("invalid concurrent Body.Read call").
		_, _ = io.CopyN(io.Discard, body, maxDrain)
	}
}

// maxDrain bounds what ServeHTTP reads of a request body the upstream
// left unread (net/http's own bound); with more, the server closes the
// connection instead of reading on.
const maxDrain = 256 << 10

func tokenEqual(got, want string) bool {
	return subtle.ConstantTimeCompare([]byte(got), []byte(want)) == 1
}

var errUnauthorized = errors.New("missing or wrong traffic access token (" + HeaderTrafficToken + ")")

func (h *Handler) proxyError(w http.ResponseWriter, r *http.Request, err error) {
	id := ""
	if rt, ok := r.Context().Value(ctxKey{}).(routed); ok {
		id = rt.target.SandboxID
	}
	if errors.Is(err, context.Canceled) {
		// The client went away; nobody reads the answer.
		return
	}
	var re *reresolveError
	if errors.As(err, &re) {
		// The retry's resolve failed (the sandbox gone, or still moving):
		// answered as any routing failure.
		h.log.Debug("proxy: resolve for a retry failed", "sandbox_id", id, "err", re.err)
		writeError(w, id, re.err)
		return
	}
	h.log.Debug("proxy upstream error", "sandbox_id", id, "err", err)
	// Whatever failed between us and the sandbox (refused, reset, gone),
	// the client sees 502, which the E2B SDKs read as "the sandbox is gone
	// or not ready".
	writeJSON(w, http.StatusBadGateway, id, fmt.Sprintf("sandbox %s: port unreachable: %v", id, err))
}

// writeError answers a routing failure the way E2B's proxy does: JSON with
// the sandbox ID, a message and the HTTP status as code.
func writeError(w http.ResponseWriter, id string, err error) {
	code := http.StatusBadGateway
	switch {
	case errors.Is(err, errUnauthorized), errdefs.IsUnauthenticated(err):
		code = http.StatusUnauthorized
	case errdefs.IsInvalidArgument(err):
		code = http.StatusBadRequest
	case errdefs.IsFailedPrecondition(err):
		code = http.StatusConflict
	case errdefs.IsAborted(err):
		// The sandbox is moving to another node and was not there within
		// the master's bound: try again shortly.
		code = http.StatusServiceUnavailable
		w.Header().Set("Retry-After", RetryAfter)
	case errdefs.IsNotFound(err), errdefs.IsUnavailable(err):
		// E2B answers 502 for a sandbox that is not there, and the SDKs
		// map 502 to "sandbox not found or timed out".
		code = http.StatusBadGateway
	}
	writeJSON(w, code, id, err.Error())
}

func writeJSON(w http.ResponseWriter, code int, id, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(struct {
		SandboxID string `json:"sandboxId,omitempty"`
		Message   string `json:"message"`
		Code      int    `json:"code"`
	}{id, msg, code})
}

// Serve serves the handler on ln (HTTP/1.1 and h2c) until ctx ends.
func (h *Handler) Serve(ctx context.Context, ln net.Listener) error {
	protocols := new(http.Protocols)
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true)
	srv := &http.Server{Handler: h, Protocols: protocols, ReadHeaderTimeout: 30 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		_ = srv.Close()
	}
	h.Close()
	return nil
}
