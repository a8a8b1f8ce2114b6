package policy

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/errdefs"
)

func TestParseDomains(t *testing.T) {
	no := false
	p, err := Parse("network", Spec{
		AllowInternet: &no,
		Allow:         []string{"API.GitHub.com.", "*.pypi.org", "198.51.100.7", "api.github.com"},
	})
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"*.pypi.org", "api.github.com"}; !slices.Equal(p.AllowDomains, want) {
		t.Errorf("domains %v, want %v (normalised, sorted, deduplicated)", p.AllowDomains, want)
	}
	if len(p.Allow) != 1 {
		t.Errorf("allow CIDRs %v", p.Allow)
	}
	back, err := Parse("", p.Spec())
	if err != nil || !back.Equal(p) {
		t.Errorf("round trip: %v %v", back, err)
	}
	if p.Equal(Policy{AllowInternet: &no, Allow: p.Allow}) {
		t.Error("Equal ignores the domains")
	}
	for _, c := range []struct {
		name   string
		answer bool
		entry  string
	}{
		{"api.github.com", true, "api.github.com"},
		{"API.GITHUB.COM.", true, "api.github.com"},
		{"files.pypi.org", true, "*.pypi.org"},
		{"a.b.pypi.org", true, "*.pypi.org"},
		{"pypi.org", false, ""}, // a wildcard covers names below it only
		{"xpypi.org", false, ""},
		{"github.com", false, ""},
		{"evil.example", false, ""},
	} {
		answer, entry := p.DNSVerdict(c.name)
		if answer != c.answer || entry != c.entry {
			t.Errorf("DNSVerdict(%q) = %v %q, want %v %q", c.name, answer, entry, c.answer, c.entry)
		}
	}
	// Internet reachable by default: every name is answered, only the
	// listed ones add addresses.
	open := Policy{AllowDomains: p.AllowDomains}
	if a, e := open.DNSVerdict("evil.example"); !a || e != "" {
		t.Errorf("open policy: %v %q", a, e)
	}
	denyAll, err := Parse("", Spec{Allow: []string{"*.pypi.org"}, Deny: []string{"0.0.0.0/0"}})
	if err != nil {
		t.Fatal(err)
	}
	if denyAll.ResolvesAll() {
		t.Error("deny_out 0.0.0.0/0 must close DNS for unlisted names, as allow_internet_access=false does")
	}
}

func TestParseDomainRejects(t *testing.T) {
	for _, c := range []struct {
		name  string
		spec  Spec
		field string
		msg   string
	}{
		{"deny domain", Spec{Deny: []string{"evil.example.com"}}, "n.deny_out[0]", "allow_out only"},
		{"inner wildcard", Spec{Allow: []string{"api.*.com"}}, "n.allow_out[0]", "wildcard"},
		{"bare wildcard", Spec{Allow: []string{"*"}}, "n.allow_out[0]", "wildcard"},
		{"single label", Spec{Allow: []string{"localhost"}}, "n.allow_out[0]", "at least two labels"},
		{"empty label", Spec{Allow: []string{"a..com"}}, "n.allow_out[0]", "label"},
		{"hyphen", Spec{Allow: []string{"-a.com"}}, "n.allow_out[0]", "hyphen"},
		{"unicode", Spec{Allow: []string{"bücher.de"}}, "n.allow_out[0]", "punycode"},
		{"ipv6 stays an address error", Spec{Allow: []string{"2001:db8::/32"}}, "n.allow_out[0]", "not IPv4"},
		{"bad address stays an address error", Spec{Allow: []string{"1.2.3.4.5"}}, "n.allow_out[0]", "not an IP address"},
		{"too long", Spec{Allow: []string{strings.Repeat("a.", 127) + "com"}}, "n.allow_out[0]", "longer"},
	} {
		_, err := Parse("n", c.spec)
		var fe *FieldError
		if !errors.As(err, &fe) || fe.Field != c.field || !strings.Contains(fe.Msg, c.msg) || !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%s: got %v, want field %s containing %q", c.name, err, c.field, c.msg)
		}
	}
}

// A label holding an escaped dot is not a subdomain of the allowed name
// its presentation form ends with; control: the real subdomain matches.
func TestMatchDomainEscapedLabel(t *testing.T) {
	entries := []string{"*.pypi.org"}
	if e, ok := MatchDomain(entries, `x.com\.pypi.org.`); ok {
		t.Errorf("escaped label matched %q", e)
	}
	if _, ok := MatchDomain(entries, "files.pypi.org."); !ok {
		t.Error("control: files.pypi.org did not match *.pypi.org")
	}
}
