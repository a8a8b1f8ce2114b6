// Package agentapi is network-agent's edge: the gRPC adapter over
// agent.Agent, the one place errors become status codes, and the HTTP
// health and metrics endpoints.
package agentapi

import (
	"context"

	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/cubesandbox/cube/api/network/v1"
	"github.com/cubesandbox/cube/internal/errdefs/grpcerr"
	"github.com/cubesandbox/cube/internal/network/agent"
	"github.com/cubesandbox/cube/internal/network/policy"
	"github.com/cubesandbox/cube/internal/network/wire"
)

// Server implements pb.NetworkAgentServer over an agent.Agent.
type Server struct {
	pb.UnimplementedNetworkAgentServer
	a *agent.Agent
}

var _ pb.NetworkAgentServer = (*Server)(nil)

// New returns the gRPC adapter for a.
func New(a *agent.Agent) *Server { return &Server{a: a} }

func (s *Server) EnsureNetwork(ctx context.Context, req *pb.EnsureNetworkRequest) (*pb.EnsureNetworkResponse, error) {
	p, err := wire.PolicyFromPB("policy", req.Policy)
	if err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	n, created, err := s.a.Ensure(ctx, agent.EnsureRequest{SandboxID: req.SandboxId, Kind: wire.KindFromPB(req.Kind), Policy: p})
	if err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	return &pb.EnsureNetworkResponse{Network: wire.NetworkToPB(n), Created: created}, nil
}

func (s *Server) ReleaseNetwork(ctx context.Context, req *pb.ReleaseNetworkRequest) (*pb.ReleaseNetworkResponse, error) {
	ok, err := s.a.Release(ctx, req.SandboxId)
	if err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	return &pb.ReleaseNetworkResponse{Released: ok}, nil
}

func (s *Server) GetNetwork(ctx context.Context, req *pb.GetNetworkRequest) (*pb.GetNetworkResponse, error) {
	n, err := s.a.Get(ctx, req.SandboxId)
	if err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	return &pb.GetNetworkResponse{Network: wire.NetworkToPB(n)}, nil
}

func (s *Server) ListNetworks(ctx context.Context, _ *pb.ListNetworksRequest) (*pb.ListNetworksResponse, error) {
	out := &pb.ListNetworksResponse{}
	for _, n := range s.a.List(ctx) {
		out.Networks = append(out.Networks, wire.NetworkToPB(n))
	}
	return out, nil
}

func (s *Server) UpdatePolicy(ctx context.Context, req *pb.UpdatePolicyRequest) (*pb.UpdatePolicyResponse, error) {
	var p *policy.Policy
	if req.Policy != nil {
		v, err := wire.PolicyFromPB("policy", req.Policy)
		if err != nil {
			return nil, grpcerr.ToGRPC(err)
		}
		p = &v
	}
	n, err := s.a.UpdatePolicy(ctx, req.SandboxId, p)
	if err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	return &pb.UpdatePolicyResponse{Network: wire.NetworkToPB(n)}, nil
}

func (s *Server) TakeEgressVerdicts(context.Context, *pb.TakeEgressVerdictsRequest) (*pb.TakeEgressVerdictsResponse, error) {
	n := s.a.TakeNotable()
	out := &pb.TakeEgressVerdictsResponse{Suppressed: map[string]int32{}}
	for _, e := range n.Events {
		out.Verdicts = append(out.Verdicts, &pb.EgressVerdict{SandboxId: e.SandboxID, Time: timestamppb.New(e.Time),
			Kind: e.Kind, Verdict: e.Verdict, Name: e.Name, Addr: e.Addr, Rule: e.Rule, Reason: e.Reason})
	}
	for id, c := range n.Suppressed {
		out.Suppressed[id] = int32(c)
	}
	return out, nil
}

func (s *Server) Reconcile(ctx context.Context, _ *pb.ReconcileRequest) (*pb.ReconcileResponse, error) {
	sum, err := s.a.Reconcile(ctx)
	if err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	return &pb.ReconcileResponse{Adopted: int32(sum.Adopted), Repaired: int32(sum.Repaired),
		Released: int32(sum.Released), Orphans: int32(sum.Orphans), Errors: sum.Errors}, nil
}

func (s *Server) Health(ctx context.Context, _ *pb.HealthRequest) (*pb.HealthResponse, error) {
	h := s.a.Health(ctx)
	out := &pb.HealthResponse{Ok: h.OK, SlotsInUse: int32(h.InUse), SlotsFree: int32(h.Free),
		PoolReady: int32(h.PoolReady), PoolTarget: int32(h.PoolTarget)}
	for _, c := range h.Conditions {
		out.Conditions = append(out.Conditions, &pb.Condition{Type: c.Type, Ok: c.OK, Message: c.Message})
	}
	return out, nil
}
