package cubeletapi

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

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/cubelet"
)

// Serve runs the gRPC API on the configured unix socket and TCP address
// and the metrics endpoint, until ctx ends. It returns once every listener
// is closed. Sandboxes are not touched on the way out.
func Serve(ctx context.Context, svc *cubelet.Service, log *slog.Logger) error {
	cfg := svc.Config()
	gs := grpc.NewServer(grpc.ChainUnaryInterceptor(logUnary(log)))
	pb.RegisterCubeletServiceServer(gs, New(svc))

	var lis []net.Listener
	closeAll := func() {
		for _, l := range lis {
			l.Close()
		}
	}
	if p := cfg.API.Socket; p != "" {
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		_ = os.Remove(p) // a stale socket of a killed cubelet
		l, err := net.Listen("unix", p)
		if err != nil {
			return fmt.Errorf("listen %s: %w", p, err)
		}
		lis = append(lis, l)
	}
	if a := cfg.API.TCP; a != "" {
		l, err := net.Listen("tcp", a)
		if err != nil {
			closeAll()
			return fmt.Errorf("listen %s: %w", a, err)
		}
		lis = append(lis, l)
	}
	var hs *http.Server
	if a := cfg.API.Metrics; a != "" {
		l, err := net.Listen("tcp", a)
		if err != nil {
			closeAll()
			return fmt.Errorf("listen %s: %w", a, err)
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
		hs = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go func() { _ = hs.Serve(l) }()
	}
	errc := make(chan error, len(lis))
	for _, l := range lis {
		log.Info("cubelet API listening", "addr", l.Addr().String())
		go func() { errc <- gs.Serve(l) }()
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
