package nodeapi

import (
	"context"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/errdefs/grpcerr"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/sandboxid"
)

// RouteServer implements masterpb.RouteServiceServer for cubeproxy
// replicas. It is served wherever AdminService is, behind the same token.
type RouteServer struct {
	masterpb.UnimplementedRouteServiceServer
	svc *master.Service
}

// ResolveRoute implements RouteService.
func (r *RouteServer) ResolveRoute(ctx context.Context, req *masterpb.ResolveRouteRequest) (*masterpb.ResolveRouteResponse, error) {
	if err := sandboxid.Validate("sandbox_id", req.SandboxId); err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	ri, err := r.svc.ResolveRoute(ctx, req.SandboxId, req.Resume, master.Presented{
		Port: int(req.Port), TrafficToken: req.TrafficAccessToken, EnvdToken: req.EnvdAccessToken,
	})
	if err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	return &masterpb.ResolveRouteResponse{
		SandboxId: ri.SandboxID, NodeId: ri.NodeID, HostIp: ri.HostIP, Pid: ri.PID,
		NodeBootId: ri.NodeBootID, NodePidNamespace: ri.NodePID, NodeDataAddress: ri.NodeDataAddr,
		TrafficAccessToken: ri.TrafficAccessToken, Resumed: ri.Resumed,
	}, nil
}

// WatchRoutes implements RouteService: a reset, then one event per change.
func (r *RouteServer) WatchRoutes(req *masterpb.WatchRoutesRequest, stream grpc.ServerStreamingServer[masterpb.RouteEvent]) error {
	if err := stream.Send(&masterpb.RouteEvent{Reset_: true}); err != nil {
		return err
	}
	err := r.svc.WatchRoutes(stream.Context(), req.ProxyId, func(c master.RouteChange) error {
		reason := "changed"
		if c.Quiesce {
			reason = "quiesce"
		}
		return stream.Send(&masterpb.RouteEvent{SandboxId: c.SandboxID, Reason: reason, Quiesce: c.Quiesce})
	})
	return grpcerr.ToGRPC(err)
}

// ReportActivity implements RouteService.
func (r *RouteServer) ReportActivity(ctx context.Context, req *masterpb.ReportActivityRequest) (*masterpb.ReportActivityResponse, error) {
	acts := make([]master.Activity, 0, len(req.Sandboxes))
	for _, a := range req.Sandboxes {
		if err := sandboxid.Validate("sandboxes.sandbox_id", a.SandboxId); err != nil {
			return nil, grpcerr.ToGRPC(err)
		}
		acts = append(acts, master.Activity{SandboxID: a.SandboxId, InFlight: int(a.InFlight), Requests: a.Requests, Quiesced: a.Quiesced})
	}
	if err := r.svc.ReportActivity(ctx, req.ProxyId, acts); err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	return &masterpb.ReportActivityResponse{}, nil
}

// streamGuard is guard for streaming calls (WatchRoutes, UploadTemplate).
func streamGuard(adminToken string) grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		admin := strings.HasPrefix(info.FullMethod, "/master.v1.RouteService/") || strings.HasPrefix(info.FullMethod, "/master.v1.AdminService/")
		if admin && adminToken != "" &&
			!tokenOK(ss.Context(), masterpb.AdminTokenHeader, adminToken) {
			return status.Error(codes.Unauthenticated, "missing or wrong admin token")
		}
		if err := adminIdentity(ss.Context(), info.FullMethod); err != nil {
			return err
		}
		return h(srv, ss)
	}
}
