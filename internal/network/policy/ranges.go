package policy

import (
	"fmt"
	"net/netip"

	"github.com/cubesandbox/cube/internal/errdefs"
)

var (
	// alwaysBlocked are unreachable from every sandbox whatever its policy
	// (the node CIDR joins them per node, see Blocked): nothing a sandbox
	// should ever talk to lives there, and link-local holds the cloud
	// metadata service (169.254.169.254), which hands out the node's
	// credentials.
	alwaysBlocked = mustPrefixes(
		"0.0.0.0/8",      // "this network"
		"127.0.0.0/8",    // loopback
		"169.254.0.0/16", // link-local, cloud metadata
		"224.0.0.0/3",    // multicast, reserved, broadcast
	)
	// Private ranges are unreachable unless the policy's allow list names
	// them: the node's own LAN and its neighbours are not "the internet".
	Private = mustPrefixes(
		"10.0.0.0/8",
		"100.64.0.0/10", // carrier-grade NAT, also used by cloud VPCs
		"172.16.0.0/12",
		"192.168.0.0/16",
	)
)

// Blocked returns the ranges no sandbox on a node with the given slot
// CIDR may reach: the always-blocked ranges plus the node CIDR, which
// holds the host's end and the host-facing address of every slot.
func Blocked(nodeCIDR netip.Prefix) []netip.Prefix {
	return append(append([]netip.Prefix(nil), alwaysBlocked...), nodeCIDR)
}

// CheckNodeCIDR validates a node's slot CIDR: IPv4, masked, and clear of
// the always-blocked ranges (the sandbox's own fixed address is
// link-local, so an overlap would make slots unroutable).
func CheckNodeCIDR(p netip.Prefix) error {
	if !p.IsValid() || !p.Addr().Is4() {
		return fmt.Errorf("node CIDR %s is not IPv4: %w", p, errdefs.ErrInvalidArgument)
	}
	if p.Masked() != p {
		return fmt.Errorf("node CIDR %s has host bits set (did you mean %s?): %w", p, p.Masked(), errdefs.ErrInvalidArgument)
	}
	for _, b := range alwaysBlocked {
		if b.Overlaps(p) {
			return fmt.Errorf("node CIDR %s overlaps %s (loopback, link-local or multicast): %w", p, b, errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

func mustPrefixes(ss ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(ss))
	for i, s := range ss {
		out[i] = netip.MustParsePrefix(s)
	}
	return out
}
