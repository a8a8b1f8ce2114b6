package agentapi

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"

	pb "github.com/cubesandbox/cube/api/network/v1"
	"github.com/cubesandbox/cube/internal/network/agent"
	"github.com/cubesandbox/cube/internal/pki"
	"github.com/cubesandbox/cube/internal/serve"
)

// Serve runs the gRPC API on the configured unix socket and /healthz,
// /readyz and /metrics on the HTTP address until ctx ends. Slots are left
// alone on the way out.
func Serve(ctx context.Context, a *agent.Agent, log *slog.Logger) error {
	cfg := a.Config()
	gs := grpc.NewServer()
	pb.RegisterNetworkAgentServer(gs, New(a))
	g := &serve.Group{Log: log}
	if p := cfg.API.Socket; p != "" {
		// Only root (cubelet) may ask for slots and change policies.
		l, err := g.Unix(p)
		if err != nil {
			return err
		}
		g.GRPC("network-agent API", gs, l)
	}
	if addr := cfg.API.HTTP; addr != "" {
		mtls, err := cfg.TLS.MutualServer("tls")
		if err != nil {
			g.Close()
			return err
		}
		l, err := g.TCP("api.http", "[tls] cert, key and ca", addr, mtls)
		if err != nil {
			g.Close()
			return err
		}
		// Over mutual TLS: operators' and the master's certificates, not
		// a node's (another node's holder would read this node's state).
		g.HTTP("network-agent health and metrics", pki.RequirePeer(HTTPHandler(a), pki.RoleAdmin, pki.RoleMaster), l)
	}
	return g.Run(ctx)
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
	// The egress proxy's own probe: 503 when an assigned sandbox has no
	// listener (its redirected connections would be refused).
	mux.HandleFunc("/egress/healthz", func(w http.ResponseWriter, r *http.Request) {
		if a.EgressStats() == nil {
			http.Error(w, "egress proxy disabled", http.StatusNotFound)
			return
		}
		if err := a.EgressHealth(); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
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
