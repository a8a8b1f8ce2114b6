package policy

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
)

// Credential is a header the node's egress proxy adds to every HTTPS
// request the sandbox sends to Host: the proxy terminates the sandbox's
// TLS for that host (with the node's egress CA, which the sandbox
// trusts), re-originates TLS to the upstream verifying its certificate,
// and sets Header to Value, replacing whatever the sandbox sent. The
// sandbox never holds Value: it lives in the policy (the agent's store and
// the proxy's memory), never in the sandbox's environment or files.
//
// Host is a domain entry as in allow_out ("api.openai.com" or
// "*.example.com"). A credential does not open its host: the policy's
// allow rules still decide whether the connection may be made.
type Credential struct {
	Host   string `json:"host"`
	Header string `json:"header"`
	Value  string `json:"value"`
}

// MaxCredentials bounds the rules of one policy.
const MaxCredentials = 64

// maxCredentialValue bounds one value (a bearer token, a basic auth).
const maxCredentialValue = 8 << 10

// forbiddenHeaders are headers a credential may not set: they frame the
// request or route it, so setting them would change what is sent rather
// than who sends it.
var forbiddenHeaders = []string{"Host", "Content-Length", "Transfer-Encoding", "Connection", "Upgrade",
	"Te", "Trailer", "Keep-Alive", "Proxy-Connection"}

func parseCredentials(field string, in []Credential) ([]Credential, error) {
	if len(in) > MaxCredentials {
		return nil, &FieldError{Field: field, Msg: fmt.Sprintf("%d entries, at most %d", len(in), MaxCredentials)}
	}
	var out []Credential
	for i, c := range in {
		f := fmt.Sprintf("%s[%d]", field, i)
		d, ok, err := ParseDomain(c.Host)
		if err == nil && !ok {
			err = fmt.Errorf("%q is not a domain name (credentials are injected by name, after TLS SNI)", c.Host)
		}
		if err != nil {
			return nil, &FieldError{Field: f + ".host", Msg: err.Error()}
		}
		h := http.CanonicalHeaderKey(strings.TrimSpace(c.Header))
		if !validToken(h) {
			return nil, &FieldError{Field: f + ".header", Msg: fmt.Sprintf("%q is not an HTTP header name", c.Header)}
		}
		if slices.Contains(forbiddenHeaders, h) {
			return nil, &FieldError{Field: f + ".header", Msg: fmt.Sprintf("%s frames or routes the request; it cannot be injected", h)}
		}
		switch {
		case c.Value == "":
			return nil, &FieldError{Field: f + ".value", Msg: "empty"}
		case len(c.Value) > maxCredentialValue:
			return nil, &FieldError{Field: f + ".value", Msg: fmt.Sprintf("longer than %d bytes", maxCredentialValue)}
		case strings.ContainsAny(c.Value, "\r\n\x00"):
			return nil, &FieldError{Field: f + ".value", Msg: "holds a line break or NUL"}
		}
		for _, o := range out {
			if o.Host == d && o.Header == h {
				return nil, &FieldError{Field: f, Msg: fmt.Sprintf("%s is injected twice for %s", h, d)}
			}
		}
		out = append(out, Credential{Host: d, Header: h, Value: c.Value})
	}
	slices.SortFunc(out, func(a, b Credential) int {
		if c := strings.Compare(a.Host, b.Host); c != 0 {
			return c
		}
		return strings.Compare(a.Header, b.Header)
	})
	return out, nil
}

func validToken(s string) bool {
	if s == "" {
		return false
	}
	for _, c := range s {
		if c > 0x7e || c <= 0x20 || strings.ContainsRune("\"(),/:;<=>?@[\\]{}", c) {
			return false
		}
	}
	return true
}

// CredentialsFor returns the credentials to inject for a request to name:
// the rules of the most specific host that covers it, as E2B's network
// rules (an exact host first, then the longest wildcard; the rule sets of
// two hosts are never merged).
func (p Policy) CredentialsFor(name string) []Credential {
	best := ""
	for _, c := range p.Credentials {
		if _, ok := MatchDomain([]string{c.Host}, name); ok && moreSpecific(c.Host, best) {
			best = c.Host
		}
	}
	var out []Credential
	for _, c := range p.Credentials {
		if best != "" && c.Host == best {
			out = append(out, c)
		}
	}
	return out
}

// moreSpecific reports whether host a (covering some name) beats host b
// ("" for none): an exact host beats a wildcard, a longer wildcard a
// shorter one.
func moreSpecific(a, b string) bool {
	switch {
	case b == "":
		return true
	case strings.HasPrefix(a, "*") != strings.HasPrefix(b, "*"):
		return !strings.HasPrefix(a, "*")
	}
	return len(a) > len(b)
}

// Proxied reports whether the sandbox's outbound TCP 80 and 443 go
// through the node's egress proxy: when its policy filters by name (domain
// entries and no default internet, so a name must be checked against the
// address), injects credentials or has request rules.
func (p Policy) Proxied() bool {
	return len(p.Credentials) > 0 || len(p.Requests) > 0 || len(p.AllowDomains) > 0 && !p.ResolvesAll()
}
