package cubeletapi

import (
	"context"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/network/policy"
	"github.com/cubesandbox/cube/internal/sandbox"
)

func (s *Server) UpdateSandboxNetwork(ctx context.Context, req *pb.UpdateSandboxNetworkRequest) (*pb.UpdateSandboxNetworkResponse, error) {
	if req.Policy == nil {
		return nil, ToGRPC(&errdefs.FieldError{Field: "policy", Msg: "required"}, req.SandboxId)
	}
	p, err := networkPolicyFromPB("policy", req.Policy)
	if err != nil {
		return nil, ToGRPC(err, req.SandboxId)
	}
	r, err := s.svc.UpdateNetwork(ctx, req.SandboxId, *p)
	if err != nil {
		return nil, ToGRPC(err, req.SandboxId)
	}
	return &pb.UpdateSandboxNetworkResponse{Sandbox: sandboxToPB(r)}, nil
}

// networkPolicyFromPB validates an API policy; nil stays nil (the node
// default). A bad entry is an InvalidArgument naming its field.
func networkPolicyFromPB(field string, p *pb.NetworkPolicy) (*policy.Policy, error) {
	if p == nil {
		return nil, nil
	}
	spec := policy.Spec{
		AllowInternet: p.AllowInternetAccess, Allow: p.AllowOut, Deny: p.DenyOut,
		MaxConnections: p.MaxConnections, EgressKbps: p.EgressKbps,
	}
	for _, c := range p.Credentials {
		spec.Credentials = append(spec.Credentials, policy.Credential{Host: c.Host, Header: c.Header, Value: c.Value})
	}
	for _, r := range p.Requests {
		spec.Requests = append(spec.Requests, policy.RequestRule{Host: r.Host, Methods: r.Methods, Paths: r.Paths})
	}
	v, err := policy.Parse(field, spec)
	if err != nil {
		return nil, err
	}
	return &v, nil
}

// networkPolicyToPB is the policy as cubelet's API shows it: credential
// rules by host and header, never their values.
func networkPolicyToPB(p policy.Policy) *pb.NetworkPolicy {
	s := p.Spec()
	out := &pb.NetworkPolicy{AllowInternetAccess: s.AllowInternet, AllowOut: s.Allow, DenyOut: s.Deny,
		MaxConnections: s.MaxConnections, EgressKbps: s.EgressKbps}
	for _, c := range s.Credentials {
		out.Credentials = append(out.Credentials, &pb.Credential{Host: c.Host, Header: c.Header})
	}
	for _, r := range s.Requests {
		out.Requests = append(out.Requests, &pb.RequestRule{Host: r.Host, Methods: r.Methods, Paths: r.Paths})
	}
	return out
}

func networkToPB(r *sandbox.Record) *pb.NetworkInfo {
	if r.Network == nil && r.NetworkPolicy == nil {
		return nil
	}
	out := &pb.NetworkInfo{}
	if r.NetworkPolicy != nil {
		out.Policy = networkPolicyToPB(*r.NetworkPolicy)
	} else {
		out.Policy = networkPolicyToPB(policy.Policy{})
	}
	if n := r.Network; n != nil {
		out.HostIp, out.SandboxIp, out.Netns = n.HostIP, n.SandboxIP, n.NetNS
	}
	return out
}
