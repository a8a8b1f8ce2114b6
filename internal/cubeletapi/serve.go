package cubeletapi

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/nodetunnel"
	"github.com/cubesandbox/cube/internal/pki"
	"github.com/cubesandbox/cube/internal/serve"
)

// Serve runs the gRPC API on the configured unix socket and TCP address
// and the metrics endpoint, until ctx ends. It returns once every listener
// is closed. Sandboxes are not touched on the way out.
func Serve(ctx context.Context, svc *cubelet.Service, log *slog.Logger) error {
	cfg := svc.Config()
	gs := serve.NewGRPCServer(grpc.ChainUnaryInterceptor(callerRole, logUnary(log)), grpc.ChainStreamInterceptor(callerRoleStream))
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
		// Over mutual TLS, the roles that may call the gRPC API: the
		// metrics name this node's sandboxes and templates.
		g.HTTP("cubelet metrics", pki.RequirePeer(mux, pki.RoleMaster, pki.RoleAdmin), l)
	}
	if a := cfg.API.Data; a != "" {
		if mtls == nil { // config.Validate refuses this; keep the listener unreachable regardless
			g.Close()
			return fmt.Errorf("api.data needs [tls]: %w", errdefs.ErrInvalidArgument)
		}
		l, err := g.TCP("api.data", tlsSetting, a, mtls)
		if err != nil {
			g.Close()
			return err
		}
		svc.SetDataAddress(l.Addr().String())
		g.HTTP("node data listener", nodetunnel.NewServer(dataLookup(svc), log), l)
	}
	// Bound listeners queue connections until Run accepts them: the
	// master may dial from now on.
	svc.Serving()
	return g.Run(ctx)
}

// dataLookup is where the node data listener finds a sandbox: this
// node's, running (a snapshot of a running one in progress included), at
// its slot's host IP or, without a slot, in its network namespace.
func dataLookup(svc *cubelet.Service) nodetunnel.Lookup {
	return func(ctx context.Context, id string) (nodetunnel.Endpoint, error) {
		rec, err := svc.Get(ctx, id)
		if err != nil {
			return nodetunnel.Endpoint{}, err
		}
		if rec.State != lifecycle.Running && (rec.State != lifecycle.Snapshotting || rec.PrevState != lifecycle.Running) {
			return nodetunnel.Endpoint{}, fmt.Errorf("sandbox %s is %s: %w", id, rec.State, errdefs.ErrFailedPrecondition)
		}
		var ep nodetunnel.Endpoint
		if rec.Network != nil {
			ep.HostIP = rec.Network.HostIP
		}
		if ep.HostIP == "" && rec.Container != nil && rec.Container.PID > 0 {
			ep.NetNS = fmt.Sprintf("/proc/%d/ns/net", rec.Container.PID)
		}
		return ep, nil
	}
}

// callerRole: over mutual TLS ([tls]) only the master and operators
// (admin certificates) may call a node; another node's certificate may
// not. Calls on the root-only socket carry no certificate.
func callerRole(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	if err := checkRole(ctx, info.FullMethod); err != nil {
		return nil, err
	}
	return h(ctx, req)
}

func callerRoleStream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
	if err := checkRole(ss.Context(), info.FullMethod); err != nil {
		return err
	}
	return h(srv, ss)
}

func checkRole(ctx context.Context, method string) error {
	cert := serve.PeerCert(ctx)
	if cert == nil {
		return nil
	}
	ou := cert.Subject.OrganizationalUnit
	if slices.Contains(ou, string(pki.RoleMaster)) || slices.Contains(ou, string(pki.RoleAdmin)) {
		return nil
	}
	return status.Errorf(codes.PermissionDenied, "%s: the caller's certificate %q has role %v, not master or admin", method, cert.Subject.CommonName, ou)
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
