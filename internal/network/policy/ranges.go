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

// ParseOpened validates the operator's list of private ranges a policy's
// allow list may open: IPv4 CIDRs or addresses, each inside one private
// range, none overlapping another.
func ParseOpened(in []string) ([]netip.Prefix, error) {
	out, _, err := parseList("open_private", in, false)
	if err != nil {
		return nil, err
	}
	for _, p := range out {
		if _, ok := within(p, Private); !ok {
			return nil, fmt.Errorf("open_private: %s is not inside a private range (%v): %w", p, Private, errdefs.ErrInvalidArgument)
		}
	}
	return out, nil
}

// CheckOpened refuses a policy whose allow list names private addresses
// the operator has not opened (opened, from ParseOpened): they would stay
// closed, and a rule that silently does nothing is a bug in the making.
// An entry that merely overlaps a private range (0.0.0.0/0) is fine: its
// private part stays closed.
func CheckOpened(field string, p Policy, opened []netip.Prefix) error {
	for _, a := range p.Allow {
		r, ok := within(a, Private)
		if !ok {
			continue
		}
		if _, ok := within(a, opened); !ok {
			// No index: Allow is sorted, so its order is not the request's.
			return &FieldError{Field: join(field, "allow_out"),
				Msg: fmt.Sprintf("%s is inside the private range %s, which this node keeps closed (the operator opens ranges with network-agent's [policy] open_private)", a, r)}
		}
	}
	return nil
}
