package policy

import (
	"errors"
	"net/url"
	"strings"
	"testing"
)

func TestParseRequestRules(t *testing.T) {
	p, err := Parse("network", Spec{Requests: []RequestRule{
		{Host: "API.GitHub.com.", Methods: []string{"get", "HEAD", "GET"}, Paths: []string{"/repos/*", "/user"}},
		{Host: "*.example.com", Methods: []string{"POST"}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	want := []RequestRule{
		{Host: "*.example.com", Methods: []string{"POST"}},
		{Host: "api.github.com", Methods: []string{"GET", "HEAD"}, Paths: []string{"/repos/*", "/user"}},
	}
	if !RequestRulesEqual(p.Requests, want) {
		t.Fatalf("parsed %+v, want %+v", p.Requests, want)
	}
	if !p.Proxied() {
		t.Fatal("a policy with request rules is not proxied")
	}
	if s := p.String(); !strings.Contains(s, "requests=*.example.com:POST:,api.github.com:GET|HEAD:/repos/*|/user") {
		t.Fatalf("String() = %q", s)
	}
	// Round trip through the request form.
	if q, err := Parse("network", p.Spec()); err != nil || !q.Equal(p) {
		t.Fatalf("round trip: %+v %v", q, err)
	}
	for _, bad := range []struct {
		r     RequestRule
		field string
	}{
		{RequestRule{Host: "10.0.0.1", Methods: []string{"GET"}}, "network.requests[0].host"},
		{RequestRule{Host: "api.github.com"}, "network.requests[0]"},
		{RequestRule{Host: "api.github.com", Methods: []string{"GE T"}}, "network.requests[0].methods[0]"},
		{RequestRule{Host: "api.github.com", Paths: []string{"repos/*"}}, "network.requests[0].paths[0]"},
		{RequestRule{Host: "api.github.com", Paths: []string{"/repos/*/issues"}}, "network.requests[0].paths[0]"},
		{RequestRule{Host: "api.github.com", Paths: []string{"/repos/../user"}}, "network.requests[0].paths[0]"},
		{RequestRule{Host: "api.github.com", Paths: []string{"/a//b"}}, "network.requests[0].paths[0]"},
		{RequestRule{Host: "api.github.com", Paths: []string{"/a?b"}}, "network.requests[0].paths[0]"},
		{RequestRule{Host: "api.github.com", Paths: []string{"/a%2fb"}}, "network.requests[0].paths[0]"},
	} {
		_, err := Parse("network", Spec{Requests: []RequestRule{bad.r}})
		var fe *FieldError
		if !errors.As(err, &fe) || fe.Field != bad.field {
			t.Errorf("%+v: %v, want a FieldError on %s", bad.r, err, bad.field)
		}
	}
}

func TestRequestAllowed(t *testing.T) {
	p, err := Parse("", Spec{Requests: []RequestRule{
		{Host: "api.github.com", Methods: []string{"GET"}, Paths: []string{"/repos/*", "/user"}},
		{Host: "api.github.com", Methods: []string{"POST"}, Paths: []string{"/repos/*"}},
		{Host: "*.github.com", Methods: []string{"DELETE"}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	// The exact host's rules apply to it, the wildcard's to the others.
	rules := p.RequestRulesFor("api.github.com")
	if len(rules) != 2 {
		t.Fatalf("rules for api.github.com: %+v", rules)
	}
	for _, c := range []struct {
		method, target string
		want           bool
	}{
		{"GET", "/repos/a/b", true},
		{"GET", "/repos/", true},
		{"GET", "/user", true},
		{"POST", "/repos/a/b", true},
		{"GET", "/user/keys", false},
		{"GET", "/users", false},
		{"GET", "/repos", false},
		{"PUT", "/repos/a/b", false},
		{"DELETE", "/repos/a/b", false}, // the wildcard's rule does not merge in
		{"GET", "/repos/../user/keys", false},
		{"GET", "/repos/%2e%2e/user/keys", false},
		{"GET", "/repos%2F..%2Fuser", false},
		{"GET", "/repos/a%2Fb", false},
		{"GET", "/repos/..;/user", false},
		{"GET", "/repos/a;x=1/b", false},
		{"GET", "/repos/..%3b/user", false},
		{"GET", "/repos/..%3B/user", false},
		{"GET", "/repos//a", false},
		{"GET", "/repos/./a", false},
		{"GET", "/repos/a\\..\\b", false},
	} {
		u, err := url.ParseRequestURI(c.target)
		if err != nil {
			t.Fatal(err)
		}
		if got := RequestAllowed(rules, c.method, u); got != c.want {
			t.Errorf("%s %s: allowed %v, want %v", c.method, c.target, got, c.want)
		}
	}
	other := p.RequestRulesFor("gist.github.com")
	u, _ := url.ParseRequestURI("/anything")
	if !RequestAllowed(other, "DELETE", u) || RequestAllowed(other, "GET", u) {
		t.Fatalf("gist.github.com: the wildcard's rule: %+v", other)
	}
	// A host without rules: everything passes.
	if !RequestAllowed(p.RequestRulesFor("example.org"), "PUT", u) {
		t.Fatal("a host without rules refused a request")
	}
}
