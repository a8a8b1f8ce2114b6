// Package policy is a sandbox's egress policy: its validated form, the
// address ranges every policy blocks, and the order in which the rules
// decide. It is pure (no kernel access) so that cubelet can validate a
// create request without talking to network-agent.
//
// Decision for a new outbound connection to address D, first match wins:
//
//  1. D in Blocked (host, node CIDR = every slot, link-local/metadata,
//     loopback, multicast/reserved)        → drop, whatever the policy
//  2. connection limit exceeded            → drop
//  3. D in Private (RFC 1918, CGNAT) and not in a range the operator
//     opened (network-agent [policy] open_private) → drop, whatever the
//     policy: a tenant cannot reach the node's LAN on its own say-so
//  4. D in Allow, or D is an address the DNS forwarder returned for a
//     name in AllowDomains (until its TTL ends) → accept (allow wins, as in E2B)
//  5. D in Deny                            → drop
//  6. D in Private                         → drop     (opened ranges need an allow)
//  7. internet off                         → drop
//  8. → accept
package policy

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// Limits on a policy's size: nftables sets are cheap, but a policy is
// part of every create request and stored per sandbox.
const (
	MaxEntries        = 1024
	MaxConnections    = 1 << 20
	MaxEgressKbps     = 100 << 20 // 100 Gbit/s
	minEgressKbps     = 8
	defaultAllowInet  = true
	describeMaxPrefix = 3
)

// Policy is a sandbox's egress policy, validated and normalised: every
// prefix is IPv4 and masked, lists are sorted and hold no overlaps.
type Policy struct {
	// AllowInternet unset (nil) means allowed.
	AllowInternet *bool          `json:"allow_internet,omitempty"`
	Allow         []netip.Prefix `json:"allow,omitempty"`
	// AllowDomains are allow_out's domain entries, normalised and sorted
	// ("api.github.com", "*.pypi.org"): see domain.go.
	AllowDomains   []string       `json:"allow_domains,omitempty"`
	Deny           []netip.Prefix `json:"deny,omitempty"`
	MaxConnections int32          `json:"max_connections,omitempty"`
	EgressKbps     int64          `json:"egress_kbps,omitempty"`
	// Credentials are headers the egress proxy injects (credential.go),
	// sorted by host and header.
	Credentials []Credential `json:"credentials,omitempty"`
	// Requests are method and path rules for hosts whose TLS the egress
	// proxy terminates (request.go), sorted by host.
	Requests []RequestRule `json:"requests,omitempty"`
}

// Spec is a policy as a request carries it (strings straight from the
// API), before Parse.
type Spec struct {
	AllowInternet  *bool
	Allow, Deny    []string
	MaxConnections int32
	EgressKbps     int64
	Credentials    []Credential
	Requests       []RequestRule
}

// InternetAllowed resolves the unset default.
func (p Policy) InternetAllowed() bool {
	if p.AllowInternet == nil {
		return defaultAllowInet
	}
	return *p.AllowInternet
}

// Equal reports whether two policies decide identically.
func (p Policy) Equal(o Policy) bool {
	return p.InternetAllowed() == o.InternetAllowed() &&
		slices.Equal(p.Allow, o.Allow) && slices.Equal(p.Deny, o.Deny) &&
		slices.Equal(p.AllowDomains, o.AllowDomains) &&
		p.MaxConnections == o.MaxConnections && p.EgressKbps == o.EgressKbps &&
		slices.Equal(p.Credentials, o.Credentials) && RequestRulesEqual(p.Requests, o.Requests)
}

// IsDefault reports whether p is the default policy (internet allowed, no
// lists, no limits): what a node without network-agent gives anyway.
func (p Policy) IsDefault() bool { return p.Equal(Policy{}) }

// Spec returns p in request form.
func (p Policy) Spec() Spec {
	s := Spec{MaxConnections: p.MaxConnections, EgressKbps: p.EgressKbps}
	if p.AllowInternet != nil {
		v := *p.AllowInternet
		s.AllowInternet = &v
	}
	for _, a := range p.Allow {
		s.Allow = append(s.Allow, a.String())
	}
	s.Allow = append(s.Allow, p.AllowDomains...)
	for _, d := range p.Deny {
		s.Deny = append(s.Deny, d.String())
	}
	s.Credentials = slices.Clone(p.Credentials)
	s.Requests = cloneRequestRules(p.Requests)
	return s
}

// Clone returns a deep copy.
func (p Policy) Clone() Policy {
	c := p
	if p.AllowInternet != nil {
		v := *p.AllowInternet
		c.AllowInternet = &v
	}
	c.Allow = slices.Clone(p.Allow)
	c.AllowDomains = slices.Clone(p.AllowDomains)
	c.Deny = slices.Clone(p.Deny)
	c.Credentials = slices.Clone(p.Credentials)
	c.Requests = cloneRequestRules(p.Requests)
	return c
}

// DenyAll is the policy of a slot no sandbox has yet: nothing leaves.
func DenyAll() Policy {
	f := false
	return Policy{AllowInternet: &f}
}

// FieldError is an InvalidArgument naming the request field at fault, so
// the API can put it in its error detail.
type FieldError = errdefs.FieldError

// Parse validates a request's policy. field prefixes error field names
// ("network" → "network.allow_out[2]").
func Parse(field string, s Spec) (Policy, error) {
	bad := func(f, format string, a ...any) error {
		return &FieldError{Field: join(field, f), Msg: fmt.Sprintf(format, a...)}
	}
	p := Policy{MaxConnections: s.MaxConnections, EgressKbps: s.EgressKbps}
	if s.AllowInternet != nil {
		v := *s.AllowInternet
		p.AllowInternet = &v
	}
	switch {
	case s.MaxConnections < 0:
		return Policy{}, bad("max_connections", "%d is negative", s.MaxConnections)
	case s.MaxConnections > MaxConnections:
		return Policy{}, bad("max_connections", "%d exceeds %d", s.MaxConnections, MaxConnections)
	case s.EgressKbps < 0:
		return Policy{}, bad("egress_kbps", "%d is negative", s.EgressKbps)
	case s.EgressKbps > MaxEgressKbps:
		return Policy{}, bad("egress_kbps", "%d exceeds %d", s.EgressKbps, MaxEgressKbps)
	case s.EgressKbps > 0 && s.EgressKbps < minEgressKbps:
		return Policy{}, bad("egress_kbps", "%d is below the %d kbps minimum (0 = unlimited)", s.EgressKbps, minEgressKbps)
	}
	var err error
	if p.Allow, p.AllowDomains, err = parseList(join(field, "allow_out"), s.Allow, true); err != nil {
		return Policy{}, err
	}
	if p.Deny, _, err = parseList(join(field, "deny_out"), s.Deny, false); err != nil {
		return Policy{}, err
	}
	if p.Credentials, err = parseCredentials(join(field, "credentials"), s.Credentials); err != nil {
		return Policy{}, err
	}
	if p.Requests, err = parseRequestRules(join(field, "requests"), s.Requests); err != nil {
		return Policy{}, err
	}
	return p, nil
}

func join(a, b string) string {
	if a == "" {
		return b
	}
	return a + "." + b
}

// parseList parses CIDRs or bare addresses, and in an allow list domain
// names (returned apart, sorted, duplicates dropped). It rejects what a user most
// likely got wrong rather than guessing: IPv6 (sandboxes have none), host
// bits set ("10.1.2.3/8"), and entries that overlap another entry of the
// same list (ambiguous intent, and nftables interval sets refuse them).
// An allow entry wholly inside an always-blocked range would silently do
// nothing, so it is an error too.
func parseList(field string, in []string, allow bool) ([]netip.Prefix, []string, error) {
	if len(in) > MaxEntries {
		return nil, nil, &FieldError{Field: field, Msg: fmt.Sprintf("%d entries, at most %d", len(in), MaxEntries)}
	}
	out := make([]netip.Prefix, 0, len(in))
	var domains []string
	for i, raw := range in {
		p, err := ParsePrefix(raw)
		if err != nil && !strings.ContainsAny(raw, ":/") {
			d, isDomain, derr := ParseDomain(raw)
			switch {
			case isDomain && derr != nil:
				err = derr
			case isDomain && !allow:
				err = fmt.Errorf("%q: domain names are accepted in allow_out only (as in E2B); deny the rest with deny_out [\"0.0.0.0/0\"] or allow_internet_access=false", raw)
			case isDomain:
				domains = append(domains, d)
				continue
			}
		}
		if err != nil {
			return nil, nil, &FieldError{Field: fmt.Sprintf("%s[%d]", field, i), Msg: err.Error()}
		}
		if allow {
			if b, ok := within(p, alwaysBlocked); ok {
				return nil, nil, &FieldError{Field: fmt.Sprintf("%s[%d]", field, i),
					Msg: fmt.Sprintf("%s is inside %s, which no sandbox may reach", p, b)}
			}
		}
		out = append(out, p)
	}
	slices.SortFunc(out, comparePrefix)
	for i := 1; i < len(out); i++ {
		if out[i-1].Overlaps(out[i]) {
			return nil, nil, &FieldError{Field: field, Msg: fmt.Sprintf("%s overlaps %s", out[i], out[i-1])}
		}
	}
	slices.Sort(domains)
	domains = slices.Compact(domains)
	if len(out) == 0 {
		out = nil
	}
	return out, domains, nil
}

// ParsePrefix parses one IPv4 CIDR or address (an address is a /32).
func ParsePrefix(s string) (netip.Prefix, error) {
	s = strings.TrimSpace(s)
	var p netip.Prefix
	if strings.Contains(s, "/") {
		var err error
		if p, err = netip.ParsePrefix(s); err != nil {
			return netip.Prefix{}, fmt.Errorf("%q is not a CIDR: %v", s, err)
		}
	} else {
		a, err := netip.ParseAddr(s)
		if err != nil {
			return netip.Prefix{}, fmt.Errorf("%q is not an IP address or CIDR", s)
		}
		p = netip.PrefixFrom(a, a.BitLen())
	}
	if a := p.Addr(); !a.Is4() || a.Is4In6() {
		return netip.Prefix{}, fmt.Errorf("%q is not IPv4 (sandboxes have no IPv6)", s)
	}
	if p.Masked() != p {
		return netip.Prefix{}, fmt.Errorf("%q has host bits set (did you mean %s?)", s, p.Masked())
	}
	return p, nil
}

func comparePrefix(a, b netip.Prefix) int {
	if c := a.Addr().Compare(b.Addr()); c != 0 {
		return c
	}
	return cmp.Compare(a.Bits(), b.Bits())
}

// within returns the entry of set that wholly contains p.
func within(p netip.Prefix, set []netip.Prefix) (netip.Prefix, bool) {
	for _, b := range set {
		if b.Bits() <= p.Bits() && b.Contains(p.Addr()) {
			return b, true
		}
	}
	return netip.Prefix{}, false
}

// String is a short human form for logs.
func (p Policy) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "internet=%v", p.InternetAllowed())
	list := func(name string, l []netip.Prefix) {
		if len(l) == 0 {
			return
		}
		fmt.Fprintf(&b, " %s=", name)
		for i, x := range l {
			if i == describeMaxPrefix {
				fmt.Fprintf(&b, ",+%d", len(l)-i)
				break
			}
			if i > 0 {
				b.WriteByte(',')
			}
			b.WriteString(x.String())
		}
	}
	list("allow", p.Allow)
	if len(p.AllowDomains) > 0 {
		fmt.Fprintf(&b, " domains=%s", strings.Join(p.AllowDomains[:min(len(p.AllowDomains), describeMaxPrefix)], ","))
		if n := len(p.AllowDomains) - describeMaxPrefix; n > 0 {
			fmt.Fprintf(&b, ",+%d", n)
		}
	}
	list("deny", p.Deny)
	if p.MaxConnections > 0 {
		fmt.Fprintf(&b, " max_conns=%d", p.MaxConnections)
	}
	if p.EgressKbps > 0 {
		fmt.Fprintf(&b, " egress_kbps=%d", p.EgressKbps)
	}
	// Hosts only: a credential's value never reaches a log.
	for i, c := range p.Credentials {
		if i == 0 {
			b.WriteString(" credentials=")
		} else {
			b.WriteByte(',')
		}
		b.WriteString(c.Host + ":" + c.Header)
	}
	for i, r := range p.Requests {
		if i == 0 {
			b.WriteString(" requests=")
		} else {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, "%s:%s:%s", r.Host, strings.Join(r.Methods, "|"), strings.Join(r.Paths, "|"))
	}
	return b.String()
}
