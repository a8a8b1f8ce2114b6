package cubeletapi

import (
	"context"
	"log/slog"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/serve"
)

// Serve runs the gRPC API on the configured unix socket and TCP address
// and the metrics endpoint, until ctx ends. It returns once every listener
// is closed. Sandboxes are not touched on the way out.
func Serve(ctx context.Context, svc *cubelet.Service, log *slog.Logger) error {
	cfg := svc.Config()
	gs := grpc.NewServer(grpc.ChainUnaryInterceptor(logUnary(log)))
	pb.RegisterCubeletServiceServer(gs, New(svc))

	mtls, err := cfg.TLS.MutualServer("tls")
	if err != nil {
		return err
	}
	const tlsSetting = "[tls] cert, key and ca"
	g := &serve.Group{Log: log}
	if p := cfg.API.Socket; p != "" {
		l, err := g.Unix(p)
		if err != nil {
			return err
		}
		g.GRPC("cubelet API", gs, l)
	}
	if a := cfg.API.TCP; a != "" {
		l, err := g.TCP("api.tcp", tlsSetting, a, mtls)
		if err != nil {
			g.Close()
			return err
		}
		g.GRPC("cubelet API", gs, l)
	}
	if a := cfg.API.Metrics; a != "" {
		l, err := g.TCP("api.metrics", tlsSetting, a, mtls)
		if err != nil {
			g.Close()
			return err
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(svc.Metrics(), promhttp.HandlerOpts{}))
		mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
			if ok, _ := svc.Health(r.Context()); !ok {
				http.Error(w, "unhealthy", http.StatusServiceUnavailable)
				return
			}
			w.WriteHeader(http.StatusNoContent)
		})
		if cfg.API.Pprof {
			registerPprof(mux)
		}
		g.HTTP("cubelet metrics", mux, l)
	}
	return g.Run(ctx)
}

func logUnary(log *slog.Logger) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		start := time.Now()
		resp, err := h(ctx, req)
		if err != nil {
			log.Debug("rpc failed", "method", info.FullMethod, "duration", time.Since(start), "err", err)
		}
		return resp, err
	}
}
