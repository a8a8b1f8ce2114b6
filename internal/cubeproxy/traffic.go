package cubeproxy

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/clientlimit"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/proxy"
)

// Metrics are cubeproxy's Prometheus series, per route (sandbox and port).
type Metrics struct {
	reg      *prometheus.Registry
	requests *prometheus.CounterVec
	bytes    *prometheus.CounterVec
	latency  *prometheus.HistogramVec
	resumes  *prometheus.CounterVec
	inFlight prometheus.Gauge
}

// NewMetrics registers the series on a private registry.
func NewMetrics() *Metrics {
	m := &Metrics{
		reg: prometheus.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cubeproxy_requests_total", Help: "Proxied requests by sandbox, port and status code.",
		}, []string{"sandbox_id", "port", "code"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cubeproxy_bytes_total", Help: "Body bytes proxied, by sandbox, port and direction (in: from clients, out: to clients).",
		}, []string{"sandbox_id", "port", "direction"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "cubeproxy_request_duration_seconds", Help: "Time from request to the end of the answer, by sandbox and port.",
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 10, 60},
		}, []string{"sandbox_id", "port"}),
		resumes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cubeproxy_resumes_total", Help: "Sandboxes resumed because traffic arrived for them (autoResume).",
		}, []string{"sandbox_id"}),
		inFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "cubeproxy_in_flight", Help: "Requests and streams open now.",
		}),
	}
	m.reg.MustRegister(m.requests, m.bytes, m.latency, m.resumes, m.inFlight)
	return m
}

func (m *Metrics) resumed(id string) { m.resumes.WithLabelValues(id).Inc() }

// Handler serves the metrics in the Prometheus text format.
func (m *Metrics) Handler() http.Handler { return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{}) }

// activity counts, per sandbox, open requests and requests since the last
// report to the master (the idle policy's input, and what a move waits on
// before it freezes a sandbox).
type activity struct {
	mu sync.Mutex
	m  map[string]*sandboxActivity
	// kick asks for a report now: a sandbox went from nothing open to
	// something open, and the master's idle check must not miss it; or
	// a quiesced sandbox's count changed, and its move waits on it.
	kick chan struct{}
}

func newActivity() *activity {
	return &activity{m: map[string]*sandboxActivity{}, kick: make(chan struct{}, 1)}
}

type sandboxActivity struct {
	open     int
	requests int64
	// quiesced: the master quiesced the sandbox for a move; it is
	// reported (marked so) until a report has said nothing is open.
	quiesced bool
}

// quiesce answers the master's quiesce event for id (the route is already
// dropped): a report now, with what is open, and another as soon as
// nothing is (end).
func (a *activity) quiesce(id string) {
	a.mu.Lock()
	s := a.m[id]
	if s == nil {
		s = &sandboxActivity{}
		a.m[id] = s
	}
	s.quiesced = true
	a.mu.Unlock()
	a.poke()
}

func (a *activity) poke() {
	select {
	case a.kick <- struct{}{}:
	default:
	}
}

func (a *activity) begin(id string) {
	a.mu.Lock()
	s := a.m[id]
	if s == nil {
		s = &sandboxActivity{}
		a.m[id] = s
	}
	s.open++
	s.requests++
	first := s.open == 1
	a.mu.Unlock()
	if first {
		a.poke()
	}
}

func (a *activity) end(id string) {
	a.mu.Lock()
	quiet := false
	if s := a.m[id]; s != nil {
		s.open--
		quiet = s.open == 0 && s.quiesced
	}
	a.mu.Unlock()
	if quiet {
		// A move waits for this: the master learns it now, not at the
		// next tick.
		a.poke()
	}
}

// take returns what to report and forgets sandboxes with nothing open and
// nothing new, after they have been reported as closed once.
func (a *activity) take() []*masterpb.SandboxActivity {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []*masterpb.SandboxActivity
	for id, s := range a.m {
		out = append(out, &masterpb.SandboxActivity{SandboxId: id, InFlight: int32(s.open), Requests: s.requests, Quiesced: s.quiesced})
		if s.open == 0 {
			delete(a.m, id) // a quiesced one too: the master has its zero
		} else {
			s.requests = 0
		}
	}
	return out
}

// report sends the activity to the master every interval until ctx ends.
func (a *activity) report(ctx context.Context, client masterpb.RouteServiceClient, proxyID string, every time.Duration, log *slog.Logger) {
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case <-a.kick:
		}
		acts := a.take()
		if len(acts) == 0 {
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		_, err := client.ReportActivity(cctx, &masterpb.ReportActivityRequest{ProxyId: proxyID, Sandboxes: acts})
		cancel()
		if err != nil && ctx.Err() == nil {
			log.Warn("report activity to the master", "err", err)
		}
	}
}

// Requests for sandboxes this replica has no route cached for that turn
// out not to exist take a token from the client's bucket (unknownBurst,
// refilled at unknownRate a second); with the bucket empty such requests
// are answered 429 without asking the master. Requests for cached routes
// (sandboxes the replica served recently) always pass, so a client that
// also probes random IDs keeps reaching its own sandboxes.
const (
	unknownRate  = 20.0
	unknownBurst = 100.0
)

// observe wraps the route: metrics, activity and one access log line per
// request. It blocks for as long as the proxied exchange lasts (an
// upgraded WebSocket included), so an open stream counts as in flight.
type observe struct {
	route   *proxy.Handler
	routes  *Routes
	unknown *clientlimit.Limiter
	metrics *Metrics
	act     *activity
	log     *slog.Logger
	local   http.Handler // /metrics and /health for requests naming no sandbox
}

func (o *observe) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	id, port, err := o.route.Route(r)
	if err != nil && o.local != nil && r.URL.Path == "/health" {
		o.local.ServeHTTP(w, r)
		return
	}
	client := clientlimit.ClientOf(r.RemoteAddr)
	if id != "" && o.unknown.Exhausted(client) && !o.routes.Cached(id) {
		o.metrics.requests.WithLabelValues("", "", strconv.Itoa(http.StatusTooManyRequests)).Inc()
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Retry-After", "1")
		w.WriteHeader(http.StatusTooManyRequests)
		_ = json.NewEncoder(w).Encode(map[string]any{"sandboxId": id, "code": http.StatusTooManyRequests,
			"message": "too many requests for sandboxes that do not exist from this client; retry later"})
		return
	}
	r = r.WithContext(proxy.WithUnresolved(r.Context(), func(err error) {
		if errdefs.IsNotFound(err) {
			o.unknown.Fail(client)
		}
	}))
	start := time.Now()
	// Per-sandbox state (activity for the idle policy, labelled series)
	// only once the route admitted the request: a flood of IDs that
	// resolve to nothing, or of requests with a wrong token, must not grow
	// it (nor the master's, which the activity reports feed).
	admitted := false
	r = r.WithContext(proxy.WithAdmitted(r.Context(), func(*proxy.Target) {
		admitted = true
		o.act.begin(id)
	}))
	defer func() {
		if admitted {
			o.act.end(id)
		}
	}()
	o.metrics.inFlight.Inc()
	defer o.metrics.inFlight.Dec()
	body := &countReader{ReadCloser: r.Body}
	if r.Body != nil && r.Body != http.NoBody {
		r.Body = body
	}
	cw := &countWriter{ResponseWriter: w, code: http.StatusOK}
	// The line and the series are written even when the exchange aborts:
	// the route panics with http.ErrAbortHandler when the sandbox or the
	// client breaks off an answer that has begun, and that is the request
	// an operator needs to see.
	aborted := true
	defer func() { o.record(r, cw, body, id, port, admitted, aborted, time.Since(start)) }()
	o.route.ServeHTTP(cw, r)
	aborted = false
}

// record writes the metrics and the access log line of one exchange.
func (o *observe) record(r *http.Request, cw *countWriter, body *countReader, id string, port int, admitted, aborted bool, d time.Duration) {
	ps, sid := strconv.Itoa(port), id
	if !admitted {
		// One series for everything the route refused.
		ps, sid = "", ""
	}
	code := cw.code
	if cw.hijacked {
		code = http.StatusSwitchingProtocols
	}
	o.metrics.requests.WithLabelValues(sid, ps, strconv.Itoa(code)).Inc()
	if admitted {
		o.metrics.bytes.WithLabelValues(sid, ps, "in").Add(float64(body.n.Load()))
		o.metrics.bytes.WithLabelValues(sid, ps, "out").Add(float64(cw.n))
		o.metrics.latency.WithLabelValues(sid, ps).Observe(d.Seconds())
	}
	o.log.Info("access", "sandbox_id", id, "port", port, "method", r.Method, "host", r.Host, "path", r.URL.Path,
		"proto", r.Proto, "status", code, "aborted", aborted, "bytes_in", body.n.Load(), "bytes_out", cw.n,
		"duration_ms", float64(d.Microseconds())/1000, "remote", r.RemoteAddr)
}

type countReader struct {
	io.ReadCloser
	n atomic.Int64
}

func (c *countReader) Read(p []byte) (int, error) {
	n, err := c.ReadCloser.Read(p)
	c.n.Add(int64(n))
	return n, err
}

// countWriter records status and body bytes. Unwrap lets
// http.ResponseController (which ReverseProxy uses to flush each write and
// to hijack upgraded connections) reach the real writer.
type countWriter struct {
	http.ResponseWriter
	code     int
	n        int64
	wrote    bool
	hijacked bool
}

func (c *countWriter) WriteHeader(code int) {
	if !c.wrote && code >= 200 {
		c.code, c.wrote = code, true
	}
	if code == http.StatusSwitchingProtocols {
		c.hijacked = true
	}
	c.ResponseWriter.WriteHeader(code)
}

func (c *countWriter) Write(p []byte) (int, error) {
	c.wrote = true
	n, err := c.ResponseWriter.Write(p)
	c.n += int64(n)
	return n, err
}

func (c *countWriter) Flush() { _ = http.NewResponseController(c.ResponseWriter).Flush() }

// Hijack marks an upgraded (WebSocket) exchange.
func (c *countWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	c.hijacked = true
	return http.NewResponseController(c.ResponseWriter).Hijack()
}

func (c *countWriter) Unwrap() http.ResponseWriter { return c.ResponseWriter }
