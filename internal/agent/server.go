// Package agent is cube-agent's API server: the envd-compatible endpoints
// that cubelet, cubeproxy and the E2B SDKs talk to inside every sandbox.
//
// Only /health exists so far. The rest of envd (the Connect services
// process.Process and filesystem.Filesystem, /files, /envs, /init) is meant
// to be added as further handlers registered in routes, on the same mux, so
// that one listener and one middleware chain serve everything.
//
// The agent runs in every sandbox, so its resident size counts: keep
// dependencies to the standard library and small, focused modules.
package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"
)

// DefaultAddr is envd's port, which E2B clients hard-code.
const DefaultAddr = ":49983"

// Config configures a Server.
type Config struct {
	Addr   string       // listen address; DefaultAddr when empty
	Logger *slog.Logger // slog.Default() when nil
}

// Server is the agent's HTTP server.
type Server struct {
	cfg     Config
	log     *slog.Logger
	handler http.Handler
}

// New builds a Server; it does not listen until Run.
func New(cfg Config) *Server {
	if cfg.Addr == "" {
		cfg.Addr = DefaultAddr
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	s := &Server{cfg: cfg, log: log}
	mux := http.NewServeMux()
	s.routes(mux)
	s.handler = mux
	return s
}

// routes is the one place endpoints are registered.
func (s *Server) routes(mux *http.ServeMux) {
	mux.HandleFunc("GET /health", s.health)
}

// Handler returns the server's full handler, for tests and for embedding.
func (s *Server) Handler() http.Handler { return s.handler }

// health answers like envd: 204 as soon as the agent serves requests.
func (s *Server) health(w http.ResponseWriter, _ *http.Request) {
	w.WriteHeader(http.StatusNoContent)
}

// Run listens on Config.Addr and serves until ctx is done, then shuts down
// gracefully (in-flight requests get up to five seconds).
func (s *Server) Run(ctx context.Context) error {
	ln, err := net.Listen("tcp", s.cfg.Addr)
	if err != nil {
		return fmt.Errorf("agent: listen %s: %w", s.cfg.Addr, err)
	}
	return s.Serve(ctx, ln)
}

// Serve is Run on an existing listener, which it closes.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	srv := &http.Server{
		Handler:           s.handler,
		ReadHeaderTimeout: 10 * time.Second,
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
		BaseContext:       func(net.Listener) context.Context { return ctx },
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	s.log.Info("agent listening", "addr", ln.Addr().String())
	select {
	case err := <-errc:
		return fmt.Errorf("agent: serve: %w", err)
	case <-ctx.Done():
	}
	shutdownCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdownCtx); err != nil {
		return fmt.Errorf("agent: shutdown: %w", err)
	}
	if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("agent: serve: %w", err)
	}
	return nil
}
