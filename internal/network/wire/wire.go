// Package wire converts between network-agent's protobuf API and the
// in-process types (package network, policy), for both ends: the server
// (agentapi) and the client cubelet uses. It imports nothing of the agent
// itself, so the client stays light. Errors cross with package
// errdefs/grpcerr, like at every gRPC edge.
package wire

import (
	"errors"

	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/cubesandbox/cube/api/network/v1"
	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/policy"
)

// KindFromPB maps the API kind (unspecified = container).
func KindFromPB(k pb.SlotKind) network.Kind {
	if k == pb.SlotKind_SLOT_KIND_VM {
		return network.VM
	}
	return network.Container
}

// KindToPB maps a kind to the API.
func KindToPB(k network.Kind) pb.SlotKind {
	if k == network.VM {
		return pb.SlotKind_SLOT_KIND_VM
	}
	return pb.SlotKind_SLOT_KIND_CONTAINER
}

// PolicyFromPB validates an API policy (nil = the default policy).
func PolicyFromPB(field string, p *pb.Policy) (policy.Policy, error) {
	if p == nil {
		return policy.Policy{}, nil
	}
	spec := policy.Spec{AllowInternet: p.AllowInternetAccess, Allow: p.AllowOut, Deny: p.DenyOut,
		MaxConnections: p.MaxConnections, EgressKbps: p.EgressKbps}
	for _, c := range p.Credentials {
		spec.Credentials = append(spec.Credentials, policy.Credential{Host: c.Host, Header: c.Header, Value: c.Value})
	}
	for _, r := range p.Requests {
		spec.Requests = append(spec.Requests, policy.RequestRule{Host: r.Host, Methods: r.Methods, Paths: r.Paths})
	}
	return policy.Parse(field, spec)
}

// PolicyToPB maps a policy to the API.
func PolicyToPB(p policy.Policy) *pb.Policy {
	s := p.Spec()
	out := &pb.Policy{AllowInternetAccess: s.AllowInternet, AllowOut: s.Allow, DenyOut: s.Deny,
		MaxConnections: s.MaxConnections, EgressKbps: s.EgressKbps}
	for _, c := range s.Credentials {
		out.Credentials = append(out.Credentials, &pb.Credential{Host: c.Host, Header: c.Header, Value: c.Value})
	}
	for _, r := range s.Requests {
		out.Requests = append(out.Requests, &pb.RequestRule{Host: r.Host, Methods: r.Methods, Paths: r.Paths})
	}
	return out
}

// withoutCredentials is p as a view shows it: credential values go to the
// agent, never back out of it.
func withoutCredentials(p policy.Policy) policy.Policy {
	p = p.Clone()
	p.Credentials = nil
	return p
}

// NetworkToPB maps a slot to the API.
func NetworkToPB(n *network.Network) *pb.Network {
	out := &pb.Network{
		SandboxId: n.SandboxID, Kind: KindToPB(n.Kind), Slot: int32(n.Slot),
		HostIp: n.HostIP, GatewayIp: n.GatewayIP, SandboxIp: n.SandboxIP,
		Netns: n.NetNS, SlotNetns: n.SlotNetNS, Tap: n.Tap, HostLink: n.HostLink,
		Policy: PolicyToPB(withoutCredentials(n.Policy)), FromPool: n.FromPool, Resolver: n.Resolver,
		EgressCa: n.EgressCA,
	}
	if !n.AssignedAt.IsZero() {
		out.AssignedAt = timestamppb.New(n.AssignedAt)
	}
	return out
}

// NetworkFromPB maps an API slot back (the client side).
func NetworkFromPB(p *pb.Network) (*network.Network, error) {
	if p == nil {
		return nil, errors.New("network-agent returned no network")
	}
	pol, err := PolicyFromPB("policy", p.Policy)
	if err != nil {
		return nil, err
	}
	n := &network.Network{
		SandboxID: p.SandboxId, Kind: KindFromPB(p.Kind), Slot: int(p.Slot),
		HostIP: p.HostIp, GatewayIP: p.GatewayIp, SandboxIP: p.SandboxIp,
		NetNS: p.Netns, SlotNetNS: p.SlotNetns, Tap: p.Tap, HostLink: p.HostLink,
		Policy: pol, FromPool: p.FromPool, Resolver: p.Resolver, EgressCA: p.EgressCa,
	}
	if p.AssignedAt != nil {
		n.AssignedAt = p.AssignedAt.AsTime()
	}
	return n, nil
}
