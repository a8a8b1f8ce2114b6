package policy

import (
	"fmt"
	"strings"
)

// Domain rules. An allow_out entry that is not an IP address or CIDR is a
// domain name: "api.github.com" (that name only) or "*.pypi.org" (every
// name below pypi.org, not pypi.org itself). As in E2B, domains are
// accepted in allow_out only: a deny list of names cannot be enforced on
// addresses (a denied name's addresses are reachable under any other
// name), so deny_out refuses them rather than pretend.
//
// Domains are enforced by the node's DNS forwarder: a name the policy
// allows is resolved, and the IPv4 addresses of the answer become
// reachable for the sandbox (rule 4 of the decision order, beside the
// allow CIDRs) until the answer's TTL runs out. A name the policy does not
// allow is answered only when the sandbox may reach the internet by
// default (see ResolvesAll); otherwise it is refused at DNS.

const maxDomainLen = 253

// ParseDomain validates and normalises one domain entry (lowercase, no
// trailing dot). ok is false when s is not meant as a domain at all (it
// has no letter and no "*", so it is a malformed address: the caller's
// address error is the better message).
func ParseDomain(s string) (d string, ok bool, err error) {
	d = strings.TrimSuffix(strings.ToLower(strings.TrimSpace(s)), ".")
	if !strings.ContainsAny(d, "abcdefghijklmnopqrstuvwxyz*_") {
		return "", false, nil
	}
	if len(d) > maxDomainLen {
		return "", true, fmt.Errorf("%q is longer than %d characters", s, maxDomainLen)
	}
	name := strings.TrimPrefix(d, "*.")
	if strings.Contains(name, "*") {
		return "", true, fmt.Errorf("%q: a wildcard is only allowed as the whole first label (\"*.example.com\")", s)
	}
	labels := strings.Split(name, ".")
	if len(labels) < 2 {
		return "", true, fmt.Errorf("%q is not an IP address, CIDR or domain name (a domain has at least two labels, e.g. example.com)", s)
	}
	for _, l := range labels {
		if l == "" || len(l) > 63 || l[0] == '-' || l[len(l)-1] == '-' {
			return "", true, fmt.Errorf("%q is not a domain name (empty, too long or hyphen-edged label %q)", s, l)
		}
		for _, c := range l {
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				return "", true, fmt.Errorf("%q is not a domain name (character %q; give internationalised names in punycode)", s, c)
			}
		}
	}
	return d, true, nil
}

// MatchDomain reports whether name (any case, trailing dot or not) is
// covered by one of the normalised domain entries.
//
// A name in presentation form with an escape (`x.com\.pypi.org`: the
// label "com.pypi") matches nothing: compared as a string it would pass
// for a name under an allowed domain it is not under.
func MatchDomain(entries []string, name string) (string, bool) {
	if strings.ContainsRune(name, '\\') {
		return "", false
	}
	name = strings.TrimSuffix(strings.ToLower(name), ".")
	for _, e := range entries {
		if suffix, ok := strings.CutPrefix(e, "*"); ok {
			if strings.HasSuffix(name, suffix) && len(name) > len(suffix) {
				return e, true
			}
		} else if name == e {
			return e, true
		}
	}
	return "", false
}

// ResolvesAll reports whether the DNS forwarder answers every name for
// this policy: when the internet is reachable by default (allowed, and no
// deny_out entry covers everything). Otherwise it answers only the names
// AllowDomains covers: a sandbox cut off from the internet gets no
// resolver to tunnel data through either.
func (p Policy) ResolvesAll() bool {
	if !p.InternetAllowed() {
		return false
	}
	for _, d := range p.Deny {
		if d.Bits() == 0 {
			return false
		}
	}
	return true
}

// DNSVerdict decides a query for name: whether to answer it, and the
// allow_out entry that matched ("" when the name is answered because the
// policy resolves everything). Addresses are added to the sandbox's
// reachable set only when entry is not "".
func (p Policy) DNSVerdict(name string) (answer bool, entry string) {
	if e, ok := MatchDomain(p.AllowDomains, name); ok {
		return true, e
	}
	return p.ResolvesAll(), ""
}
