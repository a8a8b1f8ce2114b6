package agentapi

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"

	pb "github.com/cubesandbox/cube/api/network/v1"
	"github.com/cubesandbox/cube/internal/network/agent"
)

// Serve runs the gRPC API on the configured unix socket and /healthz,
// /readyz and /metrics on the HTTP address until ctx ends. Slots are left
// alone on the way out.
func Serve(ctx context.Context, a *agent.Agent, log *slog.Logger) error {
	cfg := a.Config()
	gs := grpc.NewServer()
	pb.RegisterNetworkAgentServer(gs, New(a))
	var gl net.Listener
	if p := cfg.API.Socket; p != "" {
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		_ = os.Remove(p) // a stale socket of a killed agent
		l, err := net.Listen("unix", p)
		if err != nil {
			return fmt.Errorf("listen %s: %w", p, err)
		}
		// Only root (cubelet) may ask for slots and change policies.
		if err := os.Chmod(p, 0o600); err != nil {
			l.Close()
			return err
		}
		gl = l
	}
	var hs *http.Server
	if addr := cfg.API.HTTP; addr != "" {
		l, err := net.Listen("tcp", addr)
		if err != nil {
			if gl != nil {
				gl.Close()
			}
			return fmt.Errorf("listen %s: %w", addr, err)
		}
		hs = &http.Server{Handler: HTTPHandler(a), ReadHeaderTimeout: 5 * time.Second}
		log.Info("network-agent health and metrics", "addr", l.Addr().String())
		go func() { _ = hs.Serve(l) }()
	}
	errc := make(chan error, 1)
	if gl != nil {
		log.Info("network-agent API listening", "socket", gl.Addr().String())
		go func() { errc <- gs.Serve(gl) }()
	}
	select {
	case <-ctx.Done():
	case err := <-errc:
		if err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			log.Error("grpc serve", "err", err)
		}
	}
	stopped := make(chan struct{})
	go func() { gs.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		gs.Stop()
	}
	if hs != nil {
		_ = hs.Close()
	}
	if p := cfg.API.Socket; p != "" {
		_ = os.Remove(p)
	}
	return nil
}

// HTTPHandler serves /healthz (the process answers and its store reads),
// /readyz (started, host rules in place: cubelet may create sandboxes) and
// /metrics.
func HTTPHandler(a *agent.Agent) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(a.Metrics(), promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		for _, c := range a.Health(r.Context()).Conditions {
			if c.Type == "store" && !c.OK {
				http.Error(w, c.Message, http.StatusServiceUnavailable)
				return
			}
		}
		w.WriteHeader(http.StatusNoContent)
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) {
		h := a.Health(r.Context())
		if !h.OK {
			for _, c := range h.Conditions {
				if !c.OK {
					http.Error(w, c.Type+": "+c.Message, http.StatusServiceUnavailable)
					return
				}
			}
		}
		fmt.Fprintf(w, "ok: %d slots in use, %d/%d pooled, %d free\n", h.InUse, h.PoolReady, h.PoolTarget, h.Free)
	})
	return mux
}
