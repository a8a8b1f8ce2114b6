package nft

import (
	"fmt"
	"net/netip"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
)

// Host is what the host-namespace table is built from.
type Host struct {
	Table      string       // table name: the agent's link prefix
	LinkPrefix string       // host ends of slot veths are named LinkPrefix+N
	NodeCIDR   netip.Prefix // every slot's addresses
}

// ApplyHost replaces the agent's table in the caller's (host) namespace:
//
//	input:       iifname "P*" ct state established,related accept
//	             iifname "P*" drop                  sandboxes never reach the host
//	forward:     iifname "P*" oifname "P*" drop     nor each other
//	             oifname "P*" ct state established,related accept
//	             oifname "P*" drop                  nothing from outside opens a connection in
//	postrouting: ip saddr CIDR oifname != "P*" masquerade
//
// and "table ip6 P" (same name): input and forward drop whatever comes
// from a slot link, forward drops whatever goes to one.
//
// Base chains accept by default: the table only ever narrows what the
// node allows, so it composes with the node's own firewall (whose drops
// still apply: every table at a hook must accept a packet).
func ApplyHost(h Host) error {
	c, err := nftables.New()
	if err != nil {
		return err
	}
	t := &nftables.Table{Family: nftables.TableFamilyIPv4, Name: h.Table}
	replaceTable(c, t)
	acc := nftables.ChainPolicyAccept
	in := c.AddChain(&nftables.Chain{Name: "input", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter, Policy: &acc})
	fwd := c.AddChain(&nftables.Chain{Name: "forward", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter, Policy: &acc})
	post := c.AddChain(&nftables.Chain{Name: "postrouting", Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource, Policy: &acc})
	add := func(ch *nftables.Chain, e ...any) { c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: rule(e...)}) }

	slots := prefixMatch(h.LinkPrefix)
	established := ctState(expr.CtStateBitESTABLISHED | expr.CtStateBitRELATED)
	add(in, iifname(expr.CmpOpEq, slots), established, accept())
	add(in, iifname(expr.CmpOpEq, slots), drop())
	add(fwd, iifname(expr.CmpOpEq, slots), oifname(expr.CmpOpEq, slots), drop())
	add(fwd, oifname(expr.CmpOpEq, slots), established, accept())
	add(fwd, oifname(expr.CmpOpEq, slots), drop())
	add(post, saddrIn(h.NodeCIDR), oifname(expr.CmpOpNeq, slots), &expr.Masq{})

	// IPv6: slots have none, so nothing from a slot link is accepted
	// (the host end of every slot veth has a link-local address) and
	// nothing is forwarded to or from one.
	t6 := &nftables.Table{Family: nftables.TableFamilyIPv6, Name: h.Table}
	replaceTable(c, t6)
	in6 := c.AddChain(&nftables.Chain{Name: "input", Table: t6, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter, Policy: &acc})
	fwd6 := c.AddChain(&nftables.Chain{Name: "forward", Table: t6, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter, Policy: &acc})
	add6 := func(ch *nftables.Chain, e ...any) {
		c.AddRule(&nftables.Rule{Table: t6, Chain: ch, Exprs: rule(e...)})
	}
	add6(in6, iifname(expr.CmpOpEq, slots), drop())
	add6(fwd6, iifname(expr.CmpOpEq, slots), drop())
	add6(fwd6, oifname(expr.CmpOpEq, slots), drop())
	if err := c.Flush(); err != nil {
		return fmt.Errorf("apply host rules: %w", err)
	}
	return nil
}
