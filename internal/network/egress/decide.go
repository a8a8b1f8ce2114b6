package egress

import (
	"context"
	"net"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/cubesandbox/cube/internal/network/policy"
)

// Resolver tells whether an address belongs to a name: the node's DNS
// forwarder, which knows what it answered each sandbox.
type Resolver interface {
	// Resolved reports whether the forwarder answered name with addr to
	// the sandbox, for a name its policy allows, and the answer is live.
	Resolved(sandboxID, name string, addr netip.Addr) bool
	// LookupA resolves name through the node's resolvers.
	LookupA(ctx context.Context, name string) ([]netip.Addr, error)
}

// decision is the proxy's verdict on one connection.
type decision struct {
	allow  bool
	rule   string // the policy entry that decided
	reason string // for a denial
}

// decide applies the policy's decision order (package policy) to a
// connection to dst that claims name (TLS SNI or HTTP Host; "" when it
// claimed none). It differs from the slot's address rules in one place:
// an allow_out domain entry opens dst only when dst is one of the
// addresses of the name the connection claims (checked against the
// forwarder's answers to this sandbox, then the node's resolvers), not
// any address some allowed name once resolved to. So a forged SNI, a
// `--resolve` of a denied name to an allowed name's address and an IP
// literal without a name all fall through to the deny rules.
func (p *Proxy) decide(ctx context.Context, id string, pol policy.Policy, dst netip.Addr, name string) decision {
	for _, b := range p.blocked {
		if b.Contains(dst) {
			return decision{reason: "address in an always-blocked range (" + b.String() + ")"}
		}
	}
	// The proxy dials from the host's namespace, past the host table
	// that keeps slots off the host: an address of the host itself (a
	// name an attacker points at the node) must stay closed here too.
	if p.hostAddrs.has(dst) {
		return decision{reason: "an address of the node itself"}
	}
	private := inAny(policy.Private, dst)
	if private && !inAny(p.cfg.Opened, dst) {
		return decision{reason: "private address not opened on this node"}
	}
	for _, a := range pol.Allow {
		if a.Contains(dst) {
			return decision{allow: true, rule: a.String()}
		}
	}
	if name != "" {
		if entry, ok := policy.MatchDomain(pol.AllowDomains, name); ok {
			if p.belongs(ctx, id, name, dst) {
				return decision{allow: true, rule: entry}
			}
			if !pol.ResolvesAll() {
				return decision{reason: "address is not one of " + name + "'s"}
			}
		}
	}
	for _, d := range pol.Deny {
		if d.Contains(dst) {
			return decision{reason: "deny_out " + d.String()}
		}
	}
	if private {
		return decision{reason: "private address not in allow_out"}
	}
	if pol.InternetAllowed() {
		return decision{allow: true, rule: "internet"}
	}
	if name == "" {
		return decision{reason: "no name (TLS SNI or HTTP Host) and the address is not allowed"}
	}
	return decision{reason: "name not allowed by the policy"}
}

// belongs reports whether dst is an address of name.
func (p *Proxy) belongs(ctx context.Context, id, name string, dst netip.Addr) bool {
	if p.res == nil {
		return false
	}
	if p.res.Resolved(id, name, dst) {
		return true
	}
	ctx, cancel := context.WithTimeout(ctx, p.cfg.LookupTimeout)
	defer cancel()
	addrs, err := p.res.LookupA(ctx, name)
	return err == nil && slices.Contains(addrs, dst)
}

func inAny(set []netip.Prefix, a netip.Addr) bool {
	for _, p := range set {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// localAddrs is the host's own addresses, re-read at most every refresh.
type localAddrs struct {
	mu      sync.Mutex
	read    time.Time
	addrs   map[netip.Addr]bool
	refresh time.Duration
}

func (l *localAddrs) has(a netip.Addr) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.addrs == nil || time.Since(l.read) > l.refresh {
		m := map[netip.Addr]bool{}
		// An error leaves the previous set (or none): the slot rules
		// and the blocked ranges still hold.
		if as, err := net.InterfaceAddrs(); err == nil {
			for _, x := range as {
				if ipn, ok := x.(*net.IPNet); ok {
					if ip, ok := netip.AddrFromSlice(ipn.IP); ok {
						m[ip.Unmap()] = true
					}
				}
			}
			l.addrs, l.read = m, time.Now()
		}
	}
	return l.addrs[a]
}
