package master

import (
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// TestValidateNetwork: E2B's allowOut takes domains and wildcards beside
// CIDRs; denyOut takes no domains (as in E2B).
func TestValidateNetwork(t *testing.T) {
	for _, n := range []catalog.Network{
		{AllowOut: []string{"api.github.com", "*.pypi.org", "8.8.8.8", "10.0.0.0/8"}, DenyOut: []string{"0.0.0.0/0"}},
		{AllowOut: []string{"API.GitHub.COM."}},
		{AllowOut: []string{"api.openai.com"}, Credentials: []catalog.Credential{{Host: "api.openai.com", Header: "Authorization", Value: "Bearer sk-x"}}},
	} {
		if err := ValidateNetwork(n); err != nil {
			t.Errorf("%+v refused: %v", n, err)
		}
	}
	for _, c := range []struct {
		n   catalog.Network
		msg string
	}{
		{catalog.Network{DenyOut: []string{"evil.example.com"}}, "allowOut only"},
		{catalog.Network{AllowOut: []string{"api.*.com"}}, "wildcard"},
		{catalog.Network{AllowOut: []string{"not-a-cidr"}}, "not an IP address"},
		{catalog.Network{AllowOut: []string{"1.2.3.4/40"}}, "not a CIDR"},
		{catalog.Network{Credentials: []catalog.Credential{{Host: "api.openai.com", Header: "Host", Value: "x"}}}, "cannot be injected"},
		{catalog.Network{Credentials: []catalog.Credential{{Host: "api.openai.com", Header: "X-Key", Value: "a\r\nb"}}}, "line break"},
		{catalog.Network{Credentials: []catalog.Credential{{Host: "10.0.0.1", Header: "X-Key", Value: "x"}}}, "not a domain"},
	} {
		err := ValidateNetwork(c.n)
		if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), c.msg) {
			t.Errorf("%+v: got %v, want InvalidArgument with %q", c.n, err, c.msg)
		}
	}
}
