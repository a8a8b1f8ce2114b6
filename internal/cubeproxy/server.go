// Package cubeproxy is the sandbox data plane as a service of its own: the
// route of package proxy (host and header routing, streaming, WebSocket,
// h2c, traffic tokens) behind a route cache fed by the master (Routes),
// with auto-resume, TLS, Prometheus metrics, access logs, and activity
// reports that drive the master's idle policy. cmd/cubeproxy runs it
// alone; cubemaster runs one in-process over its own socket. Any number of
// replicas can run against one master: they share nothing but the master.
package cubeproxy

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/clientlimit"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/nodetunnel"
	"github.com/cubesandbox/cube/internal/proxy"
	"github.com/cubesandbox/cube/internal/serve"
)

// Config configures a Server.
type Config struct {
	// Listen is the proxy's address (host:port; port 0 picks one).
	Listen string
	// Domain is the suffix of <port>-<sandboxID>.<domain> hosts.
	Domain string
	TLS    TLSConfig
	// MetricsListen, when set, serves /metrics (and /health) there. The
	// proxy's own listener serves sandbox traffic and /health (to requests
	// naming no sandbox), never /metrics: its series name live sandboxes.
	MetricsListen string
	// ID names this replica in activity reports; the host name and PID
	// when empty.
	ID string
	// CacheTTL bounds how long a cached route lives (30 s when zero).
	CacheTTL time.Duration
	// ReportInterval is how often activity goes to the master (1 s when zero).
	ReportInterval time.Duration
	// Dialer reaches sandboxes (proxy.NetDialer when nil, through the
	// nodes' data listeners with NodeTLS).
	Dialer proxy.Dialer
	// NodeTLS is the client configuration for node data listeners: a
	// proxy (or master) certificate of the cluster CA. Without it,
	// sandboxes on nodes that serve one are unreachable (502).
	NodeTLS *tls.Config
	// API, when set, serves requests for the host api.<Domain> (the E2B
	// API, in-process or APIUpstream): domain mode, one TLS listener with
	// a *.<Domain> certificate for the API and every sandbox.
	API http.Handler
	// Settings names Listen, MetricsListen and TLS in errors (cubeproxy's
	// flags when empty): a listener beyond loopback without TLS is refused.
	Settings Settings
	// NoRetry answers 502 at once for a request that failed on its way
	// to a sandbox that moved, instead of sending it again where the
	// sandbox is now (proxy.Config.NoRetry).
	NoRetry bool
}

// Settings are the names of a Config's fields where they are configured.
type Settings struct{ Listen, Metrics, TLS string }

// Server is a running cubeproxy.
type Server struct {
	// Addr and MetricsAddr are the addresses actually bound.
	Addr, MetricsAddr string
	Routes            *Routes
	Metrics           *Metrics
	// TLS is the configuration served, nil for cleartext.
	TLS *tls.Config

	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	err    error
}

// Start listens and serves until ctx ends or Stop.
func Start(ctx context.Context, cfg Config, client masterpb.RouteServiceClient, log *slog.Logger) (*Server, error) {
	if log == nil {
		log = slog.Default()
	}
	if cfg.ID == "" {
		h, _ := os.Hostname()
		cfg.ID = fmt.Sprintf("%s-%d", h, os.Getpid())
	}
	if cfg.ReportInterval <= 0 {
		cfg.ReportInterval = time.Second
	}
	s := &Server{Metrics: NewMetrics()}
	var err error
	if cfg.TLS.enabled() {
		if s.TLS, err = cfg.TLS.load(cfg.Domain); err != nil {
			return nil, err
		}
	}
	names := cfg.Settings
	if names == (Settings{}) {
		names = Settings{Listen: "--listen", Metrics: "--metrics", TLS: "--tls-cert and --tls-key (or --tls-self-signed)"}
	}
	if cfg.API != nil && s.TLS == nil {
		// SDKs configured by E2B_DOMAIN only ever call https://api.<domain>;
		// a cleartext API here would carry API keys in the clear.
		return nil, fmt.Errorf("domain mode serves the E2B API on the route: it needs %s: %w", names.TLS, errdefs.ErrInvalidArgument)
	}
	ln, err := serve.ListenTCP(names.Listen, names.TLS, cfg.Listen, s.TLS != nil)
	if err != nil {
		return nil, err
	}
	var mln net.Listener
	if cfg.MetricsListen != "" {
		// The metrics listener serves the proxy's TLS too.
		if mln, err = serve.ListenTCP(names.Metrics, names.TLS, cfg.MetricsListen, s.TLS != nil); err != nil {
			ln.Close()
			return nil, err
		}
		s.MetricsAddr = mln.Addr().String()
	}
	s.Addr = ln.Addr().String()
	s.Routes = NewRoutes(client, cfg.CacheTTL, s.Metrics, log)
	if cfg.Dialer == nil {
		d := proxy.NetDialer{}
		if cfg.NodeTLS != nil {
			d.Tunnel = &nodetunnel.Dialer{TLS: cfg.NodeTLS}
		}
		cfg.Dialer = d
	}
	route := proxy.New(proxy.Config{Resolver: s.Routes, Dialer: cfg.Dialer, Domain: cfg.Domain, Log: log, NoRetry: cfg.NoRetry})
	// A sandbox destroyed while requests to it are under way: they end
	// now with 502 instead of waiting on connections a vanished network
	// stack never closes. A sandbox that moved: the attempts still on
	// their way to where it was end, and those that may be sent again go
	// where it is now (proxy.Handler.Moved).
	s.Routes.onChange = func(id string) {
		if !route.InFlight(id) {
			return
		}
		switch t, gone := s.Routes.where(context.WithoutCancel(ctx), id); {
		case gone:
			n := route.Abort(id, fmt.Errorf("sandbox %s is gone: %w", id, errdefs.ErrNotFound))
			log.Info("requests to a sandbox that went away ended", "sandbox_id", id, "requests", n)
		case t != nil:
			if n := route.Moved(id, t); n > 0 {
				log.Info("requests to a sandbox that moved ended where it was", "sandbox_id", id, "node_id", t.NodeID, "requests", n)
			}
		}
	}
	act := newActivity()
	s.Routes.proxyID, s.Routes.onQuiesce = cfg.ID, act.quiesce
	health := func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) }
	local := http.NewServeMux()
	local.HandleFunc("GET /health", health)
	metricsMux := http.NewServeMux()
	metricsMux.Handle("GET /metrics", s.Metrics.Handler())
	metricsMux.HandleFunc("GET /health", health)
	h := &observe{route: route, routes: s.Routes, unknown: clientlimit.New(unknownRate, unknownBurst), metrics: s.Metrics, act: act, log: log, local: local}

	rctx, cancel := context.WithCancel(ctx)
	s.cancel = cancel
	s.goRun(func() error { s.Routes.Watch(rctx); return nil })
	s.goRun(func() error { act.report(rctx, client, cfg.ID, cfg.ReportInterval, log); return nil })
	protocols := new(http.Protocols)
	protocols.SetHTTP1(true)
	if s.TLS != nil {
		protocols.SetHTTP2(true)
	} else {
		protocols.SetUnencryptedHTTP2(true)
	}
	var handler http.Handler = h
	if cfg.API != nil {
		handler = apiHost{domain: cfg.Domain, api: cfg.API, next: h}
	}
	srv := &http.Server{Handler: handler, Protocols: protocols, TLSConfig: s.TLS, ReadHeaderTimeout: 30 * time.Second,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug)}
	s.goRun(func() error { return serveHTTP(rctx, srv, ln, s.TLS != nil) })
	if mln != nil {
		msrv := &http.Server{Handler: metricsMux, TLSConfig: s.TLS, ReadHeaderTimeout: 10 * time.Second}
		s.goRun(func() error { return serveHTTP(rctx, msrv, mln, s.TLS != nil) })
	}
	s.goRun(func() error { <-rctx.Done(); route.Close(); return nil })
	log.Info("cubeproxy listening", "addr", s.Addr, "domain", cfg.Domain, "tls", s.TLS != nil, "api", cfg.API != nil, "metrics", s.MetricsAddr, "id", cfg.ID)
	return s, nil
}

func serveHTTP(ctx context.Context, srv *http.Server, ln net.Listener, withTLS bool) error {
	errc := make(chan error, 1)
	go func() {
		if withTLS {
			errc <- srv.ServeTLS(ln, "", "")
		} else {
			errc <- srv.Serve(ln)
		}
	}()
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
	if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

func (s *Server) goRun(fn func() error) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		if err := fn(); err != nil {
			s.mu.Lock()
			s.err = errors.Join(s.err, err)
			s.mu.Unlock()
			s.cancel()
		}
	}()
}

// Wait blocks until the server has stopped and returns why.
func (s *Server) Wait() error {
	s.wg.Wait()
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// Stop shuts the server down; open exchanges get 5 s to finish.
func (s *Server) Stop() error {
	s.cancel()
	return s.Wait()
}
