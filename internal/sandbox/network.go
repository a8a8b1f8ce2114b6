package sandbox

import "github.com/cubesandbox/cube/internal/network/policy"

// Network is the sandbox's network slot on a node with network-agent. The
// net action records it (Kind only) BEFORE asking network-agent for the
// slot, and fills in the rest once it has one; destroy clears it after the
// slot is released. The policy the sandbox asked for is
// Record.NetworkPolicy, which outlives the slot.
type Network struct {
	Kind string `json:"kind"` // "container" or "vm"
	Slot int    `json:"slot,omitempty"`
	// HostIP is where the host reaches the sandbox (every TCP port it
	// listens on): what the proxy and cubelet dial.
	HostIP    string `json:"host_ip,omitempty"`
	GatewayIP string `json:"gateway_ip,omitempty"`
	// SandboxIP is the address the sandbox sees for itself.
	SandboxIP string `json:"sandbox_ip,omitempty"`
	// NetNS is the namespace the runtime joins.
	NetNS     string `json:"netns,omitempty"`
	SlotNetNS string `json:"slot_netns,omitempty"`
	// Resolver is the nameserver the sandbox's /etc/resolv.conf names
	// (network-agent's DNS forwarder), "" when the agent runs none.
	Resolver string `json:"resolver,omitempty"`
	// EgressCA is the node's egress CA certificate (DER), which the
	// sandbox trusts (network-agent's egress proxy), nil for none.
	EgressCA []byte `json:"egress_ca,omitempty"`
}

// RuntimeNetNS is the namespace the sandbox's runtime must join, "" for
// a sandbox without a slot (the runtime makes a fresh, empty one).
func (n *Network) RuntimeNetNS() string {
	if n == nil {
		return ""
	}
	return n.NetNS
}

// ResolverOf is the nameserver for the sandbox's /etc/resolv.conf, ""
// for a sandbox without a slot or a slot without a forwarder.
func (n *Network) ResolverOf() string {
	if n == nil {
		return ""
	}
	return n.Resolver
}

// EgressCAOf is the CA certificate (DER) the sandbox's trust store gets,
// nil for a sandbox without a slot or a node without the egress proxy.
func (n *Network) EgressCAOf() []byte {
	if n == nil {
		return nil
	}
	return n.EgressCA
}

// clonePolicy deep-copies an optional policy.
func clonePolicy(p *policy.Policy) *policy.Policy {
	if p == nil {
		return nil
	}
	c := p.Clone()
	return &c
}
