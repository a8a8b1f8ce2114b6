// Package agent is cube-agent's API server: the envd-compatible endpoints
// that cubelet, cubeproxy and the E2B SDKs talk to inside every sandbox.
//
// One listener serves, behind one auth gate (auth.go):
//
//	GET  /health                 204 once serving (no auth)
//	     /process.Process/*      Connect: start, connect, list, input, signals, PTY
//	     /filesystem.Filesystem/* Connect: stat, mkdir, move, list, remove, watch
//	GET  /files, POST /files     download, upload (multipart or octet-stream, gzip)
//	GET  /envs                   variables set by /init
//	POST /init                   env vars, access token, default user/workdir, clock
//	GET  /metrics                CPU, memory, disk of the sandbox
//	     /_cube/*                cubelet only, never proxied: info, fsfreeze, fsthaw, clock,
//	                             quiesce (quiesce.go), reinit (reinit.go), prepare, logs
//
// over HTTP/1.1 and cleartext HTTP/2 (h2c with prior knowledge), as the
// SDKs' Connect transports may use either. The wire contract is envd's, as
// spoken by the pinned E2B SDK: docs/envd.md.
//
// The agent runs in every sandbox, so its resident size counts: keep
// dependencies to the standard library, x/sys and connect-go.
package agent

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/api/envd/filesystem/filesystemconnect"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
	"github.com/cubesandbox/cube/internal/agent/fsfreeze"
	"github.com/cubesandbox/cube/internal/agent/fsys"
	"github.com/cubesandbox/cube/internal/agent/identity"
	"github.com/cubesandbox/cube/internal/agent/idlemem"
	"github.com/cubesandbox/cube/internal/agent/logring"
	"github.com/cubesandbox/cube/internal/agent/procs"
	"github.com/cubesandbox/cube/internal/agent/rpcerr"
	"github.com/cubesandbox/cube/internal/agent/sysinfo"
	"github.com/cubesandbox/cube/internal/agentproto"
)

// DefaultAddr is envd's port, which E2B clients hard-code.
var DefaultAddr = ":" + strconv.Itoa(agentproto.Port)

// EnvdVersion is the envd version the agent reports: the lowest at which
// every feature the pinned SDK (e2b@2.51.0) gates is on — closeStdin
// (0.5.2), octet-stream upload (0.5.7), file metadata (0.6.2), watch with
// entries (0.6.3) and on network mounts (0.6.4) — and all are implemented.
const EnvdVersion = "0.6.4"

// DefaultLogBytes caps the sandbox's log the agent keeps in memory.
const DefaultLogBytes = 1 << 20

// maxMessageBytes bounds one Connect message the agent reads.
const maxMessageBytes = 16 << 20

// SandboxEnv picks, from the agent's own environment, the variables every
// process should inherit: all but PATH (passed on separately, first) and
// the per-user ones (HOME, USER, LOGNAME) and shell state (PWD, SHLVL),
// which belong to whoever a process runs as.
func SandboxEnv(environ []string) map[string]string {
	out := map[string]string{}
	for _, kv := range environ {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			continue
		}
		switch k {
		case "PATH", "HOME", "USER", "LOGNAME", "PWD", "OLDPWD", "SHLVL", "_":
			continue
		}
		out[k] = v
	}
	return out
}

// Config configures a Server.
type Config struct {
	Addr   string       // listen address; DefaultAddr when empty
	Logger *slog.Logger // slog.Default() when nil
	// Starter starts the processes clients ask for. In the sandbox it is
	// PID 1's initproc.Reaper; nil disables the process service
	// (FailedPrecondition).
	Starter procs.Starter
	// Users looks up the sandbox's users; its zero value reads /etc.
	Users identity.DB
	// DefaultUser acts for requests that name none, until /init sets
	// another; "user" (E2B's) when empty, root when the sandbox lacks it.
	DefaultUser string
	// DefaultWorkdir is where commands and relative paths start until
	// /init sets another; the user's home when empty.
	DefaultWorkdir string
	// FreezePath is the mount /_cube/fsfreeze freezes; "/" when empty.
	FreezePath string
	// SetClock sets the real-time clock; clock_settime when nil.
	SetClock func(unix.Timespec) error
	// Version is the agent build, reported by /_cube/info.
	Version string
	// Env seeds the sandbox-wide variables (those /init adds to): the
	// environment the runtime started the sandbox with, so the variables
	// a sandbox was created with reach every process, as in docker exec.
	Env map[string]string
	// ProcNet is where /_cube/quiesce reads the TCP tables; "/proc/net"
	// when empty.
	ProcNet string
	// WakeSignal wakes a quiesced agent (quiesce.go); SIGUSR2 when nil.
	// The runtime sends it to PID 1 after a memory restore.
	WakeSignal os.Signal
	// OnListening, when set, runs each time the agent starts listening
	// (again after a quiesce), after it logged so.
	OnListening func()
	// Logs is the sandbox's log (GET /_cube/logs): the output lines of
	// pipe processes go into it, and the caller may add its own; a ring
	// of DefaultLogBytes when nil.
	Logs *logring.Ring
	// TokenHash, when set, is the SHA-256 of the sandbox's access token
	// (agentproto.TokenHashEnv, ParseTokenHash): every request but GET
	// /health needs the token from the first one on.
	TokenHash *[sha256.Size]byte
}

// Server is the agent's HTTP server.
type Server struct {
	cfg     Config
	log     *slog.Logger
	users   identity.DB
	state   *state
	fs      *fsys.Service
	freezer *fsfreeze.Freezer
	sampler *sysinfo.Sampler
	handler http.Handler
	life    *lifecycle
	// rpc are the envd Connect services' handlers, built on first use
	// (routes) or by prebuild.
	rpc []*lazyHandler
}

// New builds a Server; it does not listen until Run.
func New(cfg Config) *Server {
	if cfg.Addr == "" {
		cfg.Addr = DefaultAddr
	}
	if cfg.DefaultUser == "" {
		cfg.DefaultUser = "user"
	}
	if cfg.SetClock == nil {
		cfg.SetClock = func(ts unix.Timespec) error { return unix.ClockSettime(unix.CLOCK_REALTIME, &ts) }
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	if cfg.Logs == nil {
		cfg.Logs = logring.New(DefaultLogBytes)
	}
	s := &Server{
		cfg:     cfg,
		log:     log,
		users:   cfg.Users,
		state:   &state{user: cfg.DefaultUser, workdir: cfg.DefaultWorkdir, env: maps.Clone(cfg.Env)},
		freezer: &fsfreeze.Freezer{Path: cfg.FreezePath, Log: log},
		sampler: &sysinfo.Sampler{},
		life:    newLifecycle(),
	}
	if cfg.TokenHash != nil {
		s.state.tokenSet, s.state.hash = true, *cfg.TokenHash
	}
	s.fs = fsys.New(cfg.Users, s.state, log)
	mux := http.NewServeMux()
	s.routes(mux)
	// Outermost, so that every request, refused ones too, counts as
	// activity: the agent's free memory goes back once it is quiet.
	s.handler = idlemem.New(idlemem.DefaultIdle, idlemem.DefaultMin).Wrap(s.withAuth(mux))
	return s
}

// routes is the one place endpoints are registered.
func (s *Server) routes(mux *http.ServeMux) {
	mux.HandleFunc("GET /health", s.health)
	mux.HandleFunc("GET /envs", s.handleEnvs)
	mux.HandleFunc("POST /init", s.handleInit)
	mux.HandleFunc("GET /metrics", s.handleMetrics)
	mux.HandleFunc("GET /files", s.fs.Download)
	mux.HandleFunc("POST /files", s.fs.Upload)

	mux.HandleFunc("GET "+agentproto.PathInfo, s.handleInfo)
	mux.HandleFunc("POST "+agentproto.PathFreeze, s.handleFreeze)
	mux.HandleFunc("POST "+agentproto.PathThaw, s.handleThaw)
	mux.HandleFunc("POST "+agentproto.PathClock, s.handleClock)
	mux.HandleFunc("POST "+agentproto.PathQuiesce, s.handleQuiesce)
	mux.HandleFunc("POST "+agentproto.PathReinit, s.handleReinit)
	mux.HandleFunc("POST "+agentproto.PathPrepare, s.handlePrepare)
	mux.HandleFunc("GET "+agentproto.PathLogs, s.handleLogs)

	// Messages are commands, paths and stdin chunks: 16 MiB is plenty, and
	// a client cannot make the agent buffer more. Most are events of a few
	// dozen bytes (start, end, keepalive, a line of output), which gzip
	// only makes longer at a cost on both sides: a message is compressed
	// only from compressMinBytes.
	opts := connect.WithHandlerOptions(
		connect.WithInterceptors(rpcerr.Interceptor()),
		connect.WithReadMaxBytes(maxMessageBytes),
		connect.WithCompressMinBytes(compressMinBytes),
	)
	var ps processconnect.ProcessHandler = processconnect.UnimplementedProcessHandler{}
	if s.cfg.Starter != nil {
		m := procs.NewManager(s.cfg.Starter, s.log)
		m.KeepOutput(s.cfg.Logs)
		ps = procs.NewService(m, s.state)
	}
	// Built on first use: the two services' handlers and the protobuf
	// descriptors they load are ~0.2 MiB of heap, which an idle sandbox
	// that is only ever asked /health would carry for its whole life
	// (its agent, never collecting, keeps every page it touched). A
	// reinit (a sandbox claimed from a warm pool, or restored from a
	// snapshot, about to be used) builds them ahead (prebuild).
	proc := newLazyHandler(func() http.Handler {
		_, h := processconnect.NewProcessHandler(ps, opts)
		return h
	})
	files := newLazyHandler(func() http.Handler {
		_, h := filesystemconnect.NewFilesystemHandler(s.fs, opts)
		return h
	})
	s.rpc = []*lazyHandler{proc, files}
	mux.Handle("/"+processconnect.ProcessName+"/", proc)
	mux.Handle("/"+filesystemconnect.FilesystemName+"/", files)
}

// compressMinBytes is the smallest Connect message the agent compresses
// (when the client accepts compression).
const compressMinBytes = 1024

// prebuild builds the Connect handlers not built yet, so that the first
// envd call does not pay for it.
func (s *Server) prebuild() {
	for _, h := range s.rpc {
		h.get()
	}
}

// handlePrepare is POST /_cube/prepare: it builds the Connect handlers
// before answering. Cubelet calls it on a warm-pool entry just before
// freezing it, so that the claim, on a create's path, finds them built
// instead of building them (about 1 ms of CPU each) while a burst of
// claims competes for the cores. It runs no garbage collection: an agent
// that has never collected is never forced to (the runtime forces one
// only two minutes after the last), so a thawed entry does not spend its
// first milliseconds collecting.
func (s *Server) handlePrepare(w http.ResponseWriter, _ *http.Request) {
	s.prebuild()
	w.WriteHeader(http.StatusNoContent)
}

// lazyHandler serves with the handler build returns, built on the first
// request or get.
type lazyHandler struct {
	get   func() http.Handler
	built atomic.Bool
}

func newLazyHandler(build func() http.Handler) *lazyHandler {
	h := &lazyHandler{}
	h.get = sync.OnceValue(func() http.Handler {
		defer h.built.Store(true)
		return build()
	})
	return h
}

func (h *lazyHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) { h.get().ServeHTTP(w, r) }

// Handler returns the server's full handler, for tests and for embedding.
func (s *Server) Handler() http.Handler { return s.handler }

// health answers like envd: 204 as soon as the agent serves requests.
func (s *Server) health(w http.ResponseWriter, _ *http.Request) {
	w.WriteHeader(http.StatusNoContent)
}

// Listen binds Config.Addr, the agent's TCP port, for Serve. The agent
// binds it before it answers anywhere else (a VM's channel): whoever sees
// an answer may take the sandbox as ready and call the port next.
func (s *Server) Listen() (net.Listener, error) {
	ln, err := net.Listen("tcp", s.cfg.Addr)
	if err != nil {
		return nil, fmt.Errorf("agent: listen %s: %w", s.cfg.Addr, err)
	}
	return ln, nil
}

// Serve serves on ln, which it closes, until ctx is done, then shuts down
// gracefully (in-flight requests get up to five seconds). After a quiesce
// (quiesce.go) it waits for the wake-up and listens again on the same
// address.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	defer s.fs.Close()
	wake := s.cfg.WakeSignal
	if wake == nil {
		wake = unix.SIGUSR2
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, wake)
	defer signal.Stop(sigs)
	go func() {
		for {
			select {
			case <-sigs:
				s.Wake()
			case <-ctx.Done():
				return
			}
		}
	}()
	addr := ln.Addr().String()
	for {
		o, err := s.serveOnce(ctx, ln)
		if err != nil || o == nil {
			return err
		}
		s.log.Info("agent quiesced: not listening until woken", "timeout", o.timeout)
		s.waitWake(ctx, o.timeout)
		if ctx.Err() != nil {
			return nil
		}
		if ln, err = relisten(ctx, addr); err != nil {
			return err
		}
	}
}

// relisten listens on addr again, retrying briefly: the port of the
// listener just closed may take a moment to be free.
func relisten(ctx context.Context, addr string) (net.Listener, error) {
	for attempt := 0; ; attempt++ {
		ln, err := net.Listen("tcp", addr)
		if err == nil || attempt == 50 || ctx.Err() != nil {
			if err != nil {
				return nil, fmt.Errorf("agent: listen %s after quiesce: %w", addr, err)
			}
			return ln, nil
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// serveOnce serves ln until ctx is done (nil order) or a quiesce tore the
// listener down (the order returned).
func (s *Server) serveOnce(ctx context.Context, ln net.Listener) (*quiesceOrder, error) {
	protocols := new(http.Protocols)
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true)
	srv := &http.Server{
		Handler:           s.handler,
		Protocols:         protocols,
		ReadHeaderTimeout: 10 * time.Second,
		// Streams (process output, watches) are long-lived: no write
		// timeout; idle keep-alive connections are closed after a while.
		IdleTimeout: 5 * time.Minute,
		ErrorLog:    slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
		BaseContext: func(net.Listener) context.Context { return ctx },
		ConnContext: func(ctx context.Context, c net.Conn) context.Context { return context.WithValue(ctx, connKey{}, c) },
		ConnState:   s.life.track,
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	s.log.Info("agent listening", "addr", ln.Addr().String(), "envd_version", EnvdVersion)
	if s.cfg.OnListening != nil {
		s.cfg.OnListening()
	}
	select {
	case err := <-errc:
		return nil, fmt.Errorf("agent: serve: %w", err)
	case o := <-s.life.quiesce:
		if err := s.quiesced(srv, ln, errc, o); err != nil {
			return nil, fmt.Errorf("agent: serve: %w", err)
		}
		return &o, nil
	case <-ctx.Done():
	}
	shutdownCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	err := srv.Shutdown(shutdownCtx)
	if errors.Is(err, context.DeadlineExceeded) {
		// Open streams (process output, watches) never go idle.
		err = srv.Close()
	}
	if err != nil {
		return nil, fmt.Errorf("agent: shutdown: %w", err)
	}
	if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
		return nil, fmt.Errorf("agent: serve: %w", err)
	}
	return nil, nil
}
