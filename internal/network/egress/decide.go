package egress

import (
	"context"
	"net"
	"net/netip"
	"slices"
	"strings"
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
	// NamesAt lists the names the forwarder answered with addr to the
	// sandbox (live answers only).
	NamesAt(sandboxID string, addr netip.Addr) []string
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

// ruleHostAt returns a host with request rules that dst is an address of
// ("" when none): an exact host when the forwarder answered it with dst
// to the sandbox or the node's resolvers answer it with dst now (cached
// for lookupCache), a wildcard host when the forwarder answered the
// sandbox dst for a name under it. A connection to such an address is
// bound to that host's rules however it names itself (see serve).
func (p *Proxy) ruleHostAt(ctx context.Context, id string, pol policy.Policy, dst netip.Addr) string {
	if len(pol.Requests) == 0 || p.res == nil {
		return ""
	}
	var answered []string
	for i, r := range pol.Requests {
		if i > 0 && pol.Requests[i-1].Host == r.Host { // sorted by host
			continue
		}
		if strings.HasPrefix(r.Host, "*.") {
			if answered == nil {
				answered = append(p.res.NamesAt(id, dst), "")
			}
			for _, n := range answered {
				if _, ok := policy.MatchDomain([]string{r.Host}, n); ok && n != "" {
					return r.Host
				}
			}
			continue
		}
		if p.res.Resolved(id, r.Host, dst) || slices.Contains(p.lookupCached(ctx, r.Host), dst) {
			return r.Host
		}
	}
	return ""
}

// lookupCache is how long ruleHostAt reuses the node's answer for a host.
const lookupCache = 30 * time.Second

// lookupCached resolves name with the node's resolvers, reusing an answer
// for lookupCache (a failed lookup too, for a tenth of that): every
// connection of a sandbox with request rules asks for each rule host.
func (p *Proxy) lookupCached(ctx context.Context, name string) []netip.Addr {
	now := time.Now()
	p.lookups.Lock()
	e, ok := p.lookups.m[name]
	p.lookups.Unlock()
	if ok && now.Before(e.expires) {
		return e.addrs
	}
	lctx, cancel := context.WithTimeout(ctx, p.cfg.LookupTimeout)
	addrs, err := p.res.LookupA(lctx, name)
	cancel()
	ttl := lookupCache
	if err != nil {
		addrs, ttl = nil, lookupCache/10
	}
	p.lookups.Lock()
	if p.lookups.m == nil || len(p.lookups.m) > 4096 {
		p.lookups.m = map[string]cachedLookup{}
	}
	p.lookups.m[name] = cachedLookup{addrs: addrs, expires: now.Add(ttl)}
	p.lookups.Unlock()
	return addrs
}

type cachedLookup struct {
	addrs   []netip.Addr
	expires time.Time
}
