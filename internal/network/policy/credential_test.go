package policy

import (
	"strings"
	"testing"
)

func TestCredentials(t *testing.T) {
	no := false
	p, err := Parse("n", Spec{AllowInternet: &no, Allow: []string{"api.openai.com"}, Credentials: []Credential{
		{Host: "API.OpenAI.com.", Header: "authorization", Value: "Bearer sk-secret"},
		{Host: "*.example.com", Header: "x-api-key", Value: "k"},
	}})
	if err != nil {
		t.Fatal(err)
	}
	if c := p.Credentials[1]; c.Host != "api.openai.com" || c.Header != "Authorization" {
		t.Errorf("not normalised/sorted: %+v", p.Credentials)
	}
	if got := p.CredentialsFor("api.openai.com"); len(got) != 1 || got[0].Value != "Bearer sk-secret" {
		t.Errorf("CredentialsFor: %+v", got)
	}
	if got := p.CredentialsFor("a.example.com"); len(got) != 1 || got[0].Header != "X-Api-Key" {
		t.Errorf("wildcard: %+v", got)
	}
	if got := p.CredentialsFor("example.com"); len(got) != 0 {
		t.Errorf("a wildcard does not cover its apex: %+v", got)
	}
	// E2B's precedence: the most specific host's rules only, never merged.
	q, err := Parse("n", Spec{Credentials: []Credential{
		{Host: "*.example.com", Header: "X-Wide", Value: "w"},
		{Host: "*.b.example.com", Header: "X-Narrow", Value: "n"},
		{Host: "a.b.example.com", Header: "X-Exact", Value: "e"},
		{Host: "a.b.example.com", Header: "X-Exact-2", Value: "e2"},
	}})
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string][]string{
		"a.b.example.com": {"X-Exact", "X-Exact-2"}, "c.b.example.com": {"X-Narrow"},
		"x.a.b.example.com": {"X-Narrow"}, "c.example.com": {"X-Wide"}, "b.example.com": {"X-Wide"},
	} {
		var got []string
		for _, c := range q.CredentialsFor(name) {
			got = append(got, c.Header)
		}
		if strings.Join(got, ",") != strings.Join(want, ",") {
			t.Errorf("CredentialsFor(%s) = %v, want %v", name, got, want)
		}
	}
	if s := p.String(); strings.Contains(s, "sk-secret") || !strings.Contains(s, "api.openai.com:Authorization") {
		t.Errorf("String: %s", s)
	}
	back, err := Parse("", p.Spec())
	if err != nil || !back.Equal(p) {
		t.Errorf("round trip: %v", err)
	}
	if q := p.Clone(); !q.Equal(p) {
		t.Error("clone")
	} else if q.Credentials[0].Value = "x"; q.Equal(p) {
		t.Error("Equal ignores credential values")
	}
	for _, c := range []struct {
		spec    Spec
		proxied bool
	}{
		{Spec{}, false},
		{Spec{Allow: []string{"api.openai.com"}}, false}, // internet on: names change nothing
		{Spec{AllowInternet: &no, Allow: []string{"api.openai.com"}}, true},
		{Spec{Allow: []string{"api.openai.com"}, Deny: []string{"0.0.0.0/0"}}, true},
		{Spec{AllowInternet: &no, Allow: []string{"198.51.100.0/24"}}, false},
		{Spec{Credentials: []Credential{{Host: "a.example.com", Header: "X-K", Value: "v"}}}, true},
	} {
		p, err := Parse("", c.spec)
		if err != nil {
			t.Fatal(err)
		}
		if p.Proxied() != c.proxied {
			t.Errorf("%+v: Proxied = %v", c.spec, !c.proxied)
		}
	}
	for _, bad := range []struct {
		c   Credential
		msg string
	}{
		{Credential{Host: "a.com", Header: "Content-Length", Value: "1"}, "cannot be injected"},
		{Credential{Host: "a.com", Header: "X K", Value: "1"}, "not an HTTP header"},
		{Credential{Host: "a.com", Header: "X-K", Value: ""}, "empty"},
		{Credential{Host: "a.com", Header: "X-K", Value: "a\nb"}, "line break"},
		{Credential{Host: "1.2.3.4", Header: "X-K", Value: "v"}, "not a domain"},
	} {
		if _, err := Parse("n", Spec{Credentials: []Credential{bad.c}}); err == nil || !strings.Contains(err.Error(), bad.msg) {
			t.Errorf("%+v: %v, want %q", bad.c, err, bad.msg)
		}
	}
	dup := []Credential{{Host: "a.com", Header: "X-K", Value: "1"}, {Host: "A.com", Header: "x-k", Value: "2"}}
	if _, err := Parse("n", Spec{Credentials: dup}); err == nil || !strings.Contains(err.Error(), "twice") {
		t.Errorf("duplicate: %v", err)
	}
}
