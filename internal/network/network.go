// Package network holds what network-agent and its clients (cubelet)
// agree on: a sandbox's slot as the API describes it. The agent itself
// lives in the subpackages:
//
//	policy     egress policy: validation and the decision order (pure)
//	ipam       node CIDR → per-slot /30 blocks (pure)
//	netnsdir   pinned network namespaces, running code inside them
//	nft        nftables rule sets through netlink
//	slot       one slot's kernel objects: converge (create/repair), release
//	slotstore  the agent's bbolt state, one record per slot
//	dnsfwd     the sandboxes' DNS forwarder: per-slot sockets, domain policy
//	egress     the egress proxy: SNI/Host checks, credential injection, egress CA
//	audit      per-sandbox JSONL of DNS queries and proxied connections
//	agent      the daemon: ensure/release/update, pool, reconcile, metrics
//	agentapi   its gRPC and HTTP edges
//	client     the gRPC client cubelet uses
//	nettest    test helpers: a "world" namespace, probes, a started agent
//
// See docs/network.md for the design and the operator's view.
package network

import (
	"fmt"
	"net/netip"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/network/policy"
)

// The sandbox's side of every slot: the same in each, so that snapshots
// and clones need no re-addressing. Runtimes that build the sandbox's
// NIC themselves (a VM's guest) configure it from these.
const (
	TapName           = "tap0" // VM slots: what the VM monitor attaches to
	SandboxPrefixBits = 30
)

var (
	// SandboxIP is every sandbox's own address.
	SandboxIP = netip.MustParseAddr("169.254.0.21")
	// SandboxGateway is the slot's address on the sandbox side.
	SandboxGateway = netip.MustParseAddr("169.254.0.22")
)

// Kind is what runs in a slot.
type Kind string

const (
	// Container: the sandbox's processes run in an inner namespace whose
	// eth0 has the fixed sandbox address.
	Container Kind = "container"
	// VM: a TAP in the slot namespace; the guest takes the fixed address
	// and the VM monitor runs in the slot namespace.
	VM Kind = "vm"
)

// ParseKind accepts "" (= container), "container" and "vm".
func ParseKind(s string) (Kind, error) {
	switch Kind(s) {
	case "", Container:
		return Container, nil
	case VM:
		return VM, nil
	}
	return "", fmt.Errorf("slot kind %q: want %q or %q: %w", s, Container, VM, errdefs.ErrInvalidArgument)
}

// Network is one sandbox's slot.
type Network struct {
	SandboxID string
	Kind      Kind
	Slot      int
	// HostIP is where the host reaches the sandbox: every TCP port the
	// sandbox listens on answers there. Unique per node.
	HostIP string
	// GatewayIP is the host end of the slot's veth pair.
	GatewayIP string
	// SandboxIP is the address the sandbox has: the same in every sandbox.
	SandboxIP string
	// EgressCA is the node's egress CA certificate (DER), nil when the
	// agent runs no egress proxy: the runtime installs it in the
	// sandbox's trust store.
	EgressCA []byte
	// NetNS is the namespace the sandbox's runtime joins.
	NetNS string
	// SlotNetNS holds the slot's NAT and policy; the sandbox never joins it.
	SlotNetNS  string
	Tap        string // VM slots
	HostLink   string
	Policy     policy.Policy
	AssignedAt time.Time
	FromPool   bool
	// Resolver is the DNS forwarder as the sandbox reaches it (an
	// address, port 53), "" when the agent runs none: what the sandbox's
	// /etc/resolv.conf names.
	Resolver string
}
