// Package nft writes the nftables rule sets of network-agent through
// netlink (github.com/google/nftables; no nft binary at run time):
//
//   - one table "slot" inside every slot namespace: NAT between the
//     sandbox's fixed address and the slot's host-facing address, and the
//     sandbox's egress policy;
//   - one table named after the agent's link prefix in the host namespace:
//     what keeps sandboxes off the host and off each other even while the
//     agent is down, and the masquerade of sandbox traffic leaving the node.
//
// Every Apply replaces its whole table in one netlink batch, which the
// kernel commits as one transaction: a packet sees the old rule set or the
// new one, never a mix, and a failed Apply leaves the old one in place.
package nft

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/network/policy"
)

// SlotTable is the name of the table inside every slot namespace.
const SlotTable = "slot"

// Slot is what the slot table is built from.
type Slot struct {
	Uplink    string     // the slot end of the veth pair to the host
	Gateway   netip.Addr // the host end's address: the only source allowed to open connections to the sandbox
	HostIP    netip.Addr // the slot's host-facing address
	SandboxIP netip.Addr // the sandbox's fixed address
	NodeCIDR  netip.Prefix
	// Opened are the private ranges the operator lets a policy's allow
	// list open; every other private address stays closed whatever the
	// policy says (an allow of 0.0.0.0/0 included).
	Opened []netip.Prefix
	// Resolver, when valid, is the slot-side address where the node's DNS
	// forwarder listens inside the slot namespace (the sandbox's gateway):
	// the input chain lets the sandbox reach it on UDP and TCP port 53,
	// and nothing else of the slot.
	Resolver netip.Addr
	// ProxyPort, when not 0, is where the node's egress proxy listens
	// inside the slot namespace (at Resolver's address). A policy that is
	// Proxied has the sandbox's new TCP connections to InterceptPorts
	// redirected there (the "proxied" set holds those ports, else it is
	// empty), and the input chain admits exactly those redirected
	// connections.
	ProxyPort uint16
	Policy    policy.Policy
}

// InterceptPorts are the destination ports the egress proxy takes over
// for a Proxied policy: HTTP (Host header) and HTTPS (TLS SNI).
var InterceptPorts = []uint16{80, 443}

// ProxiedSet is the slot table's set of intercepted ports.
const ProxiedSet = "proxied"

// ResolvedSet is the slot table's set of addresses the DNS forwarder
// returned for names the policy's domain entries allow. Each element
// expires with its answer's TTL (bounded by the forwarder).
const ResolvedSet = "resolved"

// ResolvedSetSize bounds the resolved set: the forwarder stops adding
// (and logs) once a sandbox holds this many live addresses.
const ResolvedSetSize = 16384

// afterSlotCommit, when set (tests only), runs between ApplySlot's commit
// and its reading of the generation that commit left.
var afterSlotCommit func()

// ApplySlot replaces the slot table in the namespace open at nsFD.
//
// The rule set, in nft syntax (see testdata/slot.nft for the exact one):
//
//	prerouting (nat):  iifname uplink ip saddr GW ip daddr HOSTIP dnat to SANDBOXIP
//	    iifname != uplink ip saddr SANDBOXIP tcp dport @proxied dnat to RESOLVER:PROXYPORT
//	                                          the egress proxy (when ProxyPort is set)
//	postrouting (nat): oifname uplink ip saddr SANDBOXIP snat to HOSTIP
//	input:   policy drop: nobody talks to the slot itself, except
//	    iifname lo accept
//	    ct state established,related accept
//	    iifname != uplink ip saddr SANDBOXIP ip daddr RESOLVER tcp dport 53 ct count over 16 drop
//	    iifname != uplink ip saddr SANDBOXIP ip daddr RESOLVER udp/tcp dport 53 accept
//	                                          the DNS forwarder (when Resolver is set)
//	    iifname != uplink limit rate over …   bandwidth knob (proxied traffic)
//	    iifname != uplink ip saddr SANDBOXIP ip daddr RESOLVER tcp dport PROXYPORT ct count over min(N, 1024) drop
//	    iifname != uplink ip saddr SANDBOXIP ip daddr RESOLVER tcp dport PROXYPORT ct status dnat accept
//	                                          redirected connections only
//	output:  policy drop: what the slot namespace itself sends (a VM's
//	         monitor lives there)
//	    oifname lo accept
//	    ct state established,related accept
//	    oifname != uplink ip daddr SANDBOXIP accept   cubelet → the guest's agent
//	forward: policy drop
//	    ct state invalid drop
//	    iifname != uplink ip saddr != SANDBOXIP drop   anti-spoofing
//	    ct status dnat accept                 host → sandbox ports, both ways
//	    iifname != uplink limit rate over …   bandwidth knob
//	    ct state established,related accept
//	    iifname uplink drop                   nothing else comes in
//	    ct state new jump egress              the sandbox opens a connection
//	egress: the decision of package policy, first match wins
//	    ip daddr @blocked drop
//	    ct count over N drop                  connection limit
//	    ip daddr @private ip daddr != @opened drop   closed to tenants
//	    ip daddr @allow accept
//	    ip daddr @resolved accept             answers for allowed domains
//	    ip daddr @deny drop
//	    ip daddr @private drop
//	    ip daddr @internet accept             {0.0.0.0/0} or empty
//
// Beside it, in the same transaction, "table ip6 slot" drops every IPv6
// packet the slot namespace would receive, forward or send (testdata/
// slot6.nft): the slot is IPv4 only.
//
// Everything a policy's lists and its internet switch change lives in set
// elements, so UpdateSlotPolicy can change them without touching a rule.
//
// When the table already holds exactly the chains and sets of this rule
// set, ApplySlot flushes every chain and set and refills them in the same
// single transaction (no hook is unregistered and registered again); a
// table that holds anything else (tampered with, or from an older
// version) is replaced. Either way the commit waits for an RCU grace
// period because rules are deleted (~10 ms here), which is why policy
// changes go through UpdateSlotPolicy. When nothing has committed in the
// namespace since ApplySlot's own last commit of the same Slot (gen.go),
// the table is exactly that and ApplySlot commits nothing.
func ApplySlot(nsFD int, s Slot) error {
	sum, sumErr := slotSum(s)
	var cookie uint64
	var before uint32
	if sumErr == nil {
		var current bool
		if cookie, before, current = slotCurrent(nsFD, sum); current {
			return nil
		}
	}
	c, err := nftables.New(nftables.WithNetNSFd(nsFD))
	if err != nil {
		return err
	}
	t := &nftables.Table{Family: nftables.TableFamilyIPv4, Name: SlotTable}
	exists, refill, err := shape(c, t)
	if err != nil {
		return err
	}
	if exists && !refill {
		replaceTable(c, t)
	} else {
		c.AddTable(t)
	}

	var id uint32
	set := func(name string, ps []netip.Prefix) (*nftables.Set, error) {
		id++
		st := &nftables.Set{Table: t, Name: name, ID: id, KeyType: nftables.TypeIPAddr, Interval: true}
		ps = slices.Clone(ps)
		slices.SortFunc(ps, func(a, b netip.Prefix) int { return a.Addr().Compare(b.Addr()) })
		if err := c.AddSet(st, nil); err != nil {
			return nil, fmt.Errorf("set %s: %w", name, err)
		}
		if refill {
			c.FlushSet(st)
		}
		if elems := intervalElements(ps); len(elems) > 0 {
			if err := c.SetAddElements(st, elems); err != nil {
				return nil, fmt.Errorf("set %s: %w", name, err)
			}
		}
		return st, nil
	}
	blocked, err := set("blocked", policy.Blocked(s.NodeCIDR))
	if err != nil {
		return err
	}
	private, err := set("private", policy.Private)
	if err != nil {
		return err
	}
	allow, err := set("allow", s.Policy.Allow)
	if err != nil {
		return err
	}
	deny, err := set("deny", s.Policy.Deny)
	if err != nil {
		return err
	}
	internet, err := set("internet", internetSet(s.Policy))
	if err != nil {
		return err
	}
	opened, err := set("opened", s.Opened)
	if err != nil {
		return err
	}
	// The resolved set is filled by the DNS forwarder, not from the
	// policy: a refill keeps its elements (their timeouts run on), so a
	// re-apply or a knob change does not cut a sandbox off from names it
	// resolved. The agent prunes it when the domain entries change.
	id++
	resolved := &nftables.Set{Table: t, Name: ResolvedSet, ID: id, KeyType: nftables.TypeIPAddr,
		HasTimeout: true, Size: ResolvedSetSize}
	if err := c.AddSet(resolved, nil); err != nil {
		return fmt.Errorf("set %s: %w", ResolvedSet, err)
	}
	id++
	proxied := proxiedSet(t)
	proxied.ID = id
	if err := c.AddSet(proxied, portElements(s.proxiedPorts())); err != nil {
		return fmt.Errorf("set %s: %w", ProxiedSet, err)
	}
	if refill {
		c.FlushSet(proxied)
		if els := portElements(s.proxiedPorts()); len(els) > 0 {
			if err := c.SetAddElements(proxied, els); err != nil {
				return fmt.Errorf("set %s: %w", ProxiedSet, err)
			}
		}
	}

	up := ifname(s.Uplink)
	acceptPolicy := nftables.ChainPolicyAccept
	dropPolicy := nftables.ChainPolicyDrop
	pre := c.AddChain(&nftables.Chain{Name: "prerouting", Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityNATDest, Policy: &acceptPolicy})
	post := c.AddChain(&nftables.Chain{Name: "postrouting", Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource, Policy: &acceptPolicy})
	in := c.AddChain(&nftables.Chain{Name: "input", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter, Policy: &dropPolicy})
	out := c.AddChain(&nftables.Chain{Name: "output", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookOutput, Priority: nftables.ChainPriorityFilter, Policy: &dropPolicy})
	fwd := c.AddChain(&nftables.Chain{Name: "forward", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter, Policy: &dropPolicy})
	egress := c.AddChain(&nftables.Chain{Name: "egress", Table: t})
	if refill {
		for _, ch := range []*nftables.Chain{pre, post, in, out, fwd, egress} {
			c.FlushChain(ch)
		}
	}

	add := func(ch *nftables.Chain, e ...any) { c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: rule(e...)}) }

	add(pre, iifname(expr.CmpOpEq, up), saddr(s.Gateway), daddr(s.HostIP),
		&expr.Immediate{Register: 1, Data: s.SandboxIP.AsSlice()},
		&expr.NAT{Type: expr.NATTypeDestNAT, Family: unix.NFPROTO_IPV4, RegAddrMin: 1, RegAddrMax: 1})
	if s.ProxyPort != 0 && s.Resolver.IsValid() {
		add(pre, iifname(expr.CmpOpNeq, up), saddr(s.SandboxIP), l4proto(unix.IPPROTO_TCP), dportInSet(proxied),
			&expr.Immediate{Register: 1, Data: s.Resolver.AsSlice()},
			&expr.Immediate{Register: 2, Data: binaryutil.BigEndian.PutUint16(s.ProxyPort)},
			&expr.NAT{Type: expr.NATTypeDestNAT, Family: unix.NFPROTO_IPV4, RegAddrMin: 1, RegAddrMax: 1,
				RegProtoMin: 2, RegProtoMax: 2, Specified: true})
	}
	add(post, oifname(expr.CmpOpEq, up), saddr(s.SandboxIP),
		&expr.Immediate{Register: 1, Data: s.HostIP.AsSlice()},
		&expr.NAT{Type: expr.NATTypeSourceNAT, Family: unix.NFPROTO_IPV4, RegAddrMin: 1, RegAddrMax: 1})

	add(in, iifname(expr.CmpOpEq, ifname("lo")), accept())
	proxy := s.ProxyPort != 0 && s.Resolver.IsValid()
	if kbps := s.Policy.EgressKbps; kbps > 0 && proxy {
		// What the proxy carries for the sandbox arrives here, not in
		// the forward chain: the same bandwidth knob (its own bucket).
		add(in, iifname(expr.CmpOpNeq, up), egressLimit(kbps), drop())
	}
	add(in, ctState(expr.CtStateBitESTABLISHED|expr.CtStateBitRELATED), accept())
	if proxy {
		// Only connections the prerouting rule redirected: a sandbox
		// dialling the proxy's port directly gets nothing. One proxy
		// serves every slot (two descriptors per connection): a sandbox
		// holds at most proxyConns at once, fewer under max_connections.
		limit := uint32(proxyConns)
		if p := s.Policy.MaxConnections; p > 0 && uint32(p) < limit {
			limit = uint32(p)
		}
		add(in, iifname(expr.CmpOpNeq, up), saddr(s.SandboxIP), daddr(s.Resolver), l4proto(unix.IPPROTO_TCP),
			dport(s.ProxyPort), &expr.Connlimit{Count: limit, Flags: nftConnlimitInvert}, drop())
		add(in, iifname(expr.CmpOpNeq, up), saddr(s.SandboxIP), daddr(s.Resolver), l4proto(unix.IPPROTO_TCP),
			dport(s.ProxyPort), ctStatusDNAT(), accept())
	}
	if s.Resolver.IsValid() {
		// One forwarder serves every slot: a sandbox holding open TCP
		// connections to it (each a descriptor and a goroutine there
		// until it times out) is cut at dnsTCPConns.
		add(in, iifname(expr.CmpOpNeq, up), saddr(s.SandboxIP), daddr(s.Resolver),
			l4proto(unix.IPPROTO_TCP), dport(DNSPort),
			&expr.Connlimit{Count: dnsTCPConns, Flags: nftConnlimitInvert}, drop())
		for _, proto := range []byte{unix.IPPROTO_UDP, unix.IPPROTO_TCP} {
			add(in, iifname(expr.CmpOpNeq, up), saddr(s.SandboxIP), daddr(s.Resolver),
				l4proto(proto), dport(DNSPort), accept())
		}
	}

	// A VM's monitor runs in this namespace (it opens the TAP here), so a
	// monitor compromised from the guest would send from it, past the
	// forward chain that holds the guest's policy. The namespace itself
	// opens connections only to the sandbox (cubelet entering it to reach
	// a guest's agent) and on loopback; nothing it starts goes out the
	// uplink.
	add(out, oifname(expr.CmpOpEq, ifname("lo")), accept())
	add(out, ctState(expr.CtStateBitESTABLISHED|expr.CtStateBitRELATED), accept())
	add(out, oifname(expr.CmpOpNeq, up), daddr(s.SandboxIP), accept())

	add(fwd, ctState(expr.CtStateBitINVALID), drop())
	// Anti-spoofing: whatever comes from the sandbox's side carries the
	// sandbox's own address, or it goes nowhere (a raw socket could
	// otherwise forge any source, for reflection from the node's address).
	add(fwd, iifname(expr.CmpOpNeq, up), saddrNot(s.SandboxIP), drop())
	add(fwd, ctStatusDNAT(), accept())
	if kbps := s.Policy.EgressKbps; kbps > 0 {
		add(fwd, iifname(expr.CmpOpNeq, up), egressLimit(kbps), drop())
	}
	add(fwd, ctState(expr.CtStateBitESTABLISHED|expr.CtStateBitRELATED), accept())
	add(fwd, iifname(expr.CmpOpEq, up), drop())
	add(fwd, ctState(expr.CtStateBitNEW), jump(egress.Name))

	p := s.Policy
	add(egress, daddrInSet(blocked), drop())
	if p.MaxConnections > 0 {
		add(egress, &expr.Connlimit{Count: uint32(p.MaxConnections), Flags: nftConnlimitInvert}, drop())
	}
	add(egress, daddrInSet(private), daddrNotInSet(opened), drop())
	add(egress, daddrInSet(allow), accept())
	add(egress, daddrInSet(resolved), accept())
	add(egress, daddrInSet(deny), drop())
	add(egress, daddrInSet(private), drop())
	add(egress, daddrInSet(internet), accept())
	applyNoIPv6(c, SlotTable)
	if err := c.Flush(); err != nil {
		return fmt.Errorf("apply slot rules: %w", err)
	}
	if afterSlotCommit != nil {
		afterSlotCommit()
	}
	if sumErr == nil {
		rememberSlot(nsFD, cookie, before, sum, false)
	}
	return nil
}

// limitBurst is the egress limit's burst in bytes: two 64 KiB GSO packets.
const limitBurst = 128 << 10

// egressLimit matches packets over the bandwidth knob. The kernel's byte
// bucket holds one second of the rate plus the burst; the burst must
// exceed the largest (GSO) packet, or a slow rate could never pass one.
func egressLimit(kbps int64) expr.Any {
	rate := uint64(kbps) * 1000 / 8 // bytes per second
	return &expr.Limit{Type: expr.LimitTypePktBytes, Rate: rate, Unit: expr.LimitTimeSecond, Over: true, Burst: limitBurst}
}

// proxiedPorts are the elements of the proxied set for this slot.
func (s Slot) proxiedPorts() []uint16 {
	if s.ProxyPort == 0 || !s.Resolver.IsValid() || !s.Policy.Proxied() {
		return nil
	}
	return InterceptPorts
}

func proxiedSet(t *nftables.Table) *nftables.Set {
	return &nftables.Set{Table: t, Name: ProxiedSet, KeyType: nftables.TypeInetService}
}

func portElements(ports []uint16) []nftables.SetElement {
	out := make([]nftables.SetElement, 0, len(ports))
	for _, p := range ports {
		out = append(out, nftables.SetElement{Key: binaryutil.BigEndian.PutUint16(p)})
	}
	return out
}

var everything = []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0")}

func internetSet(p policy.Policy) []netip.Prefix {
	if p.InternetAllowed() {
		return everything
	}
	return nil
}

// UpdateSlotPolicy changes the slot table in the namespace open at nsFD
// from policy prev to s.Policy. When only the lists or the internet switch
// differ (the rules stay the same), it rewrites set elements only, in one
// transaction. Deleting anything (a rule, a set element) makes the commit
// wait for an RCU grace period (~10 ms here), so a set that only gains
// elements gets just the new ones: assigning a pooled slot (deny-all:
// every set empty) never deletes. Any other change, or a table that is
// not in the expected shape, goes through ApplySlot.
func UpdateSlotPolicy(nsFD int, s Slot, prev policy.Policy) error {
	if prev.MaxConnections != s.Policy.MaxConnections || prev.EgressKbps != s.Policy.EgressKbps {
		return ApplySlot(nsFD, s)
	}
	c, err := nftables.New(nftables.WithNetNSFd(nsFD))
	if err != nil {
		return err
	}
	t := &nftables.Table{Family: nftables.TableFamilyIPv4, Name: SlotTable}
	if _, ok, err := shape(c, t); err != nil || !ok {
		if err != nil {
			return err
		}
		return ApplySlot(nsFD, s)
	}
	prevSlot := s
	prevSlot.Policy = prev
	// The update turns ApplySlot(prevSlot)'s table into ApplySlot(s)'s
	// (TestUpdateSlotPolicyEqualsApply): when the table was known to be
	// the former, the result is remembered as the latter (gen.go).
	prevSum, perr := slotSum(prevSlot)
	sum, serr := slotSum(s)
	var cookie uint64
	var before uint32
	known := false
	if perr == nil && serr == nil {
		cookie, before, known = slotCurrent(nsFD, prevSum)
	}
	for _, x := range []struct {
		name     string
		old, new []netip.Prefix
	}{
		{"allow", prev.Allow, s.Policy.Allow},
		{"deny", prev.Deny, s.Policy.Deny},
		{"internet", internetSet(prev), internetSet(s.Policy)},
	} {
		st := &nftables.Set{Table: t, Name: x.name, KeyType: nftables.TypeIPAddr, Interval: true}
		add := x.new
		if removed, added := diff(x.old, x.new); len(removed) == 0 {
			add = added
		} else {
			c.FlushSet(st)
		}
		if elems := intervalElements(add); len(elems) > 0 {
			if err := c.SetAddElements(st, elems); err != nil {
				return fmt.Errorf("set %s: %w", x.name, err)
			}
		}
	}
	// The proxied set follows the policy's Proxied switch: all the
	// intercepted ports or none.
	if was, now := prevSlot.proxiedPorts(), s.proxiedPorts(); !slices.Equal(was, now) {
		st := proxiedSet(t)
		if len(was) > 0 {
			c.FlushSet(st)
		}
		if len(now) > 0 {
			if err := c.SetAddElements(st, portElements(now)); err != nil {
				return fmt.Errorf("set %s: %w", ProxiedSet, err)
			}
		}
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("update slot policy: %w", err)
	}
	if known {
		rememberSlot(nsFD, cookie, before, sum, true)
	}
	return nil
}

// diff returns what is in old but not in new, and in new but not in old.
func diff(old, cur []netip.Prefix) (removed, added []netip.Prefix) {
	for _, p := range old {
		if !slices.Contains(cur, p) {
			removed = append(removed, p)
		}
	}
	for _, p := range cur {
		if !slices.Contains(old, p) {
			added = append(added, p)
		}
	}
	return removed, added
}

// slotChains and slotSets are the names ApplySlot creates.
var (
	slotChains = []string{"egress", "forward", "input", "output", "postrouting", "prerouting"}
	slotSets   = []string{"allow", "blocked", "deny", "internet", "opened", "private", ProxiedSet, ResolvedSet}
)

// shape reports whether table t exists and whether it holds exactly the
// chains and sets of a slot rule set (so it can be refilled in place).
func shape(c *nftables.Conn, t *nftables.Table) (exists, same bool, err error) {
	chains, err := c.ListChainsOfTableFamily(t.Family)
	if err != nil {
		return false, false, fmt.Errorf("list chains: %w", err)
	}
	var names []string
	for _, ch := range chains {
		if ch.Table.Name == t.Name {
			names = append(names, ch.Name)
		}
	}
	if len(names) == 0 {
		// No chains: the table is absent or holds only sets (tampered
		// with: replace it). An absent table makes GetSets fail.
		sets, err := c.GetSets(t)
		return err == nil && len(sets) > 0, false, nil
	}
	slices.Sort(names)
	if !slices.Equal(names, slotChains) {
		return true, false, nil
	}
	sets, err := c.GetSets(t)
	if err != nil {
		return true, false, fmt.Errorf("list sets: %w", err)
	}
	names = names[:0]
	for _, st := range sets {
		names = append(names, st.Name)
	}
	slices.Sort(names)
	return true, slices.Equal(names, slotSets), nil
}

// DNSPort is where the forwarder listens.
const DNSPort = 53

// Resolved is one address of a DNS answer and how long it stays reachable.
type Resolved struct {
	Addr    netip.Addr
	Timeout time.Duration
}

// AddResolved adds addresses to the resolved set of the slot table in the
// namespace open at nsFD, in one transaction. An address already there
// gets the new timeout (the kernel updates an existing element's timeout
// on a re-add). Only additions: the commit never waits for an RCU grace
// period, which matters because the DNS answer waits for it.
func AddResolved(nsFD int, rs []Resolved) error {
	if len(rs) == 0 {
		return nil
	}
	c, err := nftables.New(nftables.WithNetNSFd(nsFD))
	if err != nil {
		return err
	}
	st := resolvedSet()
	elems := make([]nftables.SetElement, 0, len(rs))
	for _, r := range rs {
		elems = append(elems, nftables.SetElement{Key: r.Addr.AsSlice(), Timeout: r.Timeout})
	}
	if err := c.SetAddElements(st, elems); err != nil {
		return err
	}
	return besideSlot(nsFD, func() error {
		if err := c.Flush(); err != nil {
			return fmt.Errorf("add to set %s: %w", ResolvedSet, err)
		}
		return nil
	})
}

// PruneResolved removes from the resolved set every address not in keep
// (all of them when keep is nil), in one transaction: what an update that
// drops domain entries needs, so that names no longer allowed stop being
// reachable at once.
func PruneResolved(nsFD int, keep []Resolved) error {
	c, err := nftables.New(nftables.WithNetNSFd(nsFD))
	if err != nil {
		return err
	}
	st := resolvedSet()
	c.FlushSet(st)
	if len(keep) > 0 {
		elems := make([]nftables.SetElement, 0, len(keep))
		for _, r := range keep {
			elems = append(elems, nftables.SetElement{Key: r.Addr.AsSlice(), Timeout: r.Timeout})
		}
		if err := c.SetAddElements(st, elems); err != nil {
			return err
		}
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("prune set %s: %w", ResolvedSet, err)
	}
	return nil
}

// ListResolved returns the live elements of the resolved set.
func ListResolved(nsFD int) ([]Resolved, error) {
	c, err := nftables.New(nftables.WithNetNSFd(nsFD))
	if err != nil {
		return nil, err
	}
	els, err := c.GetSetElements(resolvedSet())
	if err != nil {
		return nil, fmt.Errorf("list set %s: %w", ResolvedSet, err)
	}
	out := make([]Resolved, 0, len(els))
	for _, e := range els {
		if a, ok := netip.AddrFromSlice(e.Key); ok {
			out = append(out, Resolved{Addr: a, Timeout: e.Expires})
		}
	}
	return out, nil
}

func resolvedSet() *nftables.Set {
	return &nftables.Set{Table: &nftables.Table{Family: nftables.TableFamilyIPv4, Name: SlotTable},
		Name: ResolvedSet, KeyType: nftables.TypeIPAddr, HasTimeout: true}
}

// proxyConns is how many connections through the egress proxy a sandbox
// may hold open at once.
const proxyConns = 1024

// dnsTCPConns is how many TCP connections a sandbox may hold open to the
// DNS forwarder at once (a resolver needs one or two, for answers that do
// not fit UDP).
const dnsTCPConns = 16

// nftConnlimitInvert makes connlimit match when the count is OVER the
// limit (`ct count over N`); without it, it matches up to N.
const nftConnlimitInvert = 1

// replaceTable queues "create if missing, delete, create" so that the
// table's new content lands in the same transaction as the removal of the
// old one.
func replaceTable(c *nftables.Conn, t *nftables.Table) {
	c.AddTable(t)
	c.DelTable(t)
	c.AddTable(t)
}

// HasTable reports whether the namespace open at nsFD (-1: the caller's)
// has an IPv4 table called name.
func HasTable(nsFD int, name string) (bool, error) {
	return hasTable(nsFD, nftables.TableFamilyIPv4, name)
}

// HasTable6 reports whether the namespace open at nsFD (-1: the caller's)
// has an IPv6 table called name.
func HasTable6(nsFD int, name string) (bool, error) {
	return hasTable(nsFD, nftables.TableFamilyIPv6, name)
}

func hasTable(nsFD int, family nftables.TableFamily, name string) (bool, error) {
	tables, err := tablesOf(nsFD, family)
	if err != nil {
		return false, err
	}
	return slices.Contains(tables, name), nil
}

// Tables lists the IPv4 tables of the namespace open at nsFD (-1: the
// caller's).
func Tables(nsFD int) ([]string, error) {
	return tablesOf(nsFD, nftables.TableFamilyIPv4)
}

func conn(nsFD int) (*nftables.Conn, error) {
	var opts []nftables.ConnOption
	if nsFD >= 0 {
		opts = append(opts, nftables.WithNetNSFd(nsFD))
	}
	return nftables.New(opts...)
}

func tablesOf(nsFD int, family nftables.TableFamily) ([]string, error) {
	c, err := conn(nsFD)
	if err != nil {
		return nil, err
	}
	ts, err := c.ListTablesOfFamily(family)
	if err != nil {
		return nil, fmt.Errorf("list nft tables: %w", err)
	}
	var out []string
	for _, t := range ts {
		out = append(out, t.Name)
	}
	return out, nil
}

// DeleteTable removes the tables called name, IPv4 and IPv6 (the agent's
// rule sets come in such pairs), from the namespace open at nsFD (-1: the
// caller's); a missing table is not an error.
func DeleteTable(nsFD int, name string) error {
	return deleteTable(nsFD, name, nftables.TableFamilyIPv4, nftables.TableFamilyIPv6)
}

// DeleteTable6 removes only the IPv6 table called name.
func DeleteTable6(nsFD int, name string) error {
	return deleteTable(nsFD, name, nftables.TableFamilyIPv6)
}

func deleteTable(nsFD int, name string, families ...nftables.TableFamily) error {
	c, err := conn(nsFD)
	if err != nil {
		return err
	}
	n := 0
	for _, f := range families {
		ok, err := hasTable(nsFD, f, name)
		if err != nil {
			return err
		}
		if ok {
			c.DelTable(&nftables.Table{Family: f, Name: name})
			n++
		}
	}
	if n == 0 {
		return nil
	}
	if err := c.Flush(); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("delete nft table %s: %w", name, err)
	}
	return nil
}

// applyNoIPv6 queues, in c's batch, the IPv6 table name whose input,
// forward and output chains drop everything. Slots are IPv4 only and
// their namespaces have IPv6 disabled; this table is what still holds if
// IPv6 comes on there (a sysctl flipped, a kernel default changed), so an
// IPv6 path can never bypass the IPv4 policy. Re-applying it is a no-op
// (base chains without rules, created if missing).
func applyNoIPv6(c *nftables.Conn, name string) {
	t := c.AddTable(&nftables.Table{Family: nftables.TableFamilyIPv6, Name: name})
	drop := nftables.ChainPolicyDrop
	for _, h := range []struct {
		name string
		hook *nftables.ChainHook
	}{{"input", nftables.ChainHookInput}, {"forward", nftables.ChainHookForward}, {"output", nftables.ChainHookOutput}} {
		c.AddChain(&nftables.Chain{Name: h.name, Table: t, Type: nftables.ChainTypeFilter,
			Hooknum: h.hook, Priority: nftables.ChainPriorityFilter, Policy: &drop})
	}
}
