package policy

import (
	"fmt"
	"net/url"
	"path"
	"slices"
	"strings"
)

// RequestRule lets through the HTTP requests to Host whose method is one
// of Methods (none: any) and whose path matches one of Paths (none: any;
// "/repos/*" is every path under /repos/, "/user" that path alone). When a
// host has request rules the egress proxy terminates the sandbox's TLS for
// it (as for a credential) and refuses, with 403, every request that no
// rule of the host lets through; plain HTTP to the host is checked the
// same way. Like credentials, only the most specific host's rules apply
// to a name (an exact host over a wildcard, a longer wildcard over a
// shorter one), and a request rule does not open its host: allow_out
// still decides the connection.
type RequestRule struct {
	Host    string   `json:"host"`
	Methods []string `json:"methods,omitempty"`
	Paths   []string `json:"paths,omitempty"`
}

// Bounds of request rules.
const (
	MaxRequestRules = 64
	maxRulePaths    = 64
	maxRuleMethods  = 16
	maxRulePath     = 1024
)

func parseRequestRules(field string, in []RequestRule) ([]RequestRule, error) {
	if len(in) > MaxRequestRules {
		return nil, &FieldError{Field: field, Msg: fmt.Sprintf("%d entries, at most %d", len(in), MaxRequestRules)}
	}
	var out []RequestRule
	for i, r := range in {
		f := fmt.Sprintf("%s[%d]", field, i)
		d, ok, err := ParseDomain(r.Host)
		if err == nil && !ok {
			err = fmt.Errorf("%q is not a domain name (request rules apply by name, after TLS SNI or HTTP Host)", r.Host)
		}
		if err != nil {
			return nil, &FieldError{Field: f + ".host", Msg: err.Error()}
		}
		if len(r.Methods) == 0 && len(r.Paths) == 0 {
			return nil, &FieldError{Field: f, Msg: "a rule names methods, paths or both"}
		}
		if len(r.Methods) > maxRuleMethods {
			return nil, &FieldError{Field: f + ".methods", Msg: fmt.Sprintf("%d entries, at most %d", len(r.Methods), maxRuleMethods)}
		}
		if len(r.Paths) > maxRulePaths {
			return nil, &FieldError{Field: f + ".paths", Msg: fmt.Sprintf("%d entries, at most %d", len(r.Paths), maxRulePaths)}
		}
		rule := RequestRule{Host: d}
		for j, m := range r.Methods {
			m = strings.ToUpper(strings.TrimSpace(m))
			if !validToken(m) {
				return nil, &FieldError{Field: fmt.Sprintf("%s.methods[%d]", f, j), Msg: fmt.Sprintf("%q is not an HTTP method", r.Methods[j])}
			}
			if !slices.Contains(rule.Methods, m) {
				rule.Methods = append(rule.Methods, m)
			}
		}
		for j, p := range r.Paths {
			if msg := badRulePath(p); msg != "" {
				return nil, &FieldError{Field: fmt.Sprintf("%s.paths[%d]", f, j), Msg: msg}
			}
			if !slices.Contains(rule.Paths, p) {
				rule.Paths = append(rule.Paths, p)
			}
		}
		slices.Sort(rule.Methods)
		slices.Sort(rule.Paths)
		out = append(out, rule)
	}
	slices.SortStableFunc(out, func(a, b RequestRule) int { return strings.Compare(a.Host, b.Host) })
	return out, nil
}

// badRulePath says what is wrong with a rule's path ("" when nothing): an
// absolute, clean path, "*" only as its last character.
func badRulePath(p string) string {
	switch {
	case !strings.HasPrefix(p, "/"):
		return fmt.Sprintf("%q does not start with /", p)
	case len(p) > maxRulePath:
		return fmt.Sprintf("longer than %d bytes", maxRulePath)
	case strings.ContainsAny(p, " \t\r\n\x00?#%"):
		return fmt.Sprintf("%q holds a space, control character, ?, # or %%", p)
	case strings.Contains(strings.TrimSuffix(p, "*"), "*"):
		return fmt.Sprintf("%q: * only at the end", p)
	}
	if base := strings.TrimSuffix(p, "*"); !cleanPath(base) {
		return fmt.Sprintf("%q is not a clean path (no //, . or .. segments)", p)
	}
	return ""
}

// cleanPath: p has no empty, "." or ".." segment (a trailing / allowed).
func cleanPath(p string) bool {
	c := path.Clean(p)
	return c == p || c+"/" == p
}

// RequestRulesFor returns the request rules for name: those of the most
// specific host that covers it (the precedence of CredentialsFor).
func (p Policy) RequestRulesFor(name string) []RequestRule {
	best := ""
	for _, r := range p.Requests {
		if _, ok := MatchDomain([]string{r.Host}, name); ok && moreSpecific(r.Host, best) {
			best = r.Host
		}
	}
	var out []RequestRule
	for _, r := range p.Requests {
		if best != "" && r.Host == best {
			out = append(out, r)
		}
	}
	return out
}

// RequestAllowed reports whether rules (a host's, from RequestRulesFor;
// none lets everything through) let a request for method and u through.
// A path that is not clean (//, . or .. segments, also when
// percent-encoded), that holds an encoded / or \, or a ; (plain or
// encoded: Tomcat and Spring drop a segment's ";parameters", so
// /repos/..;/user is /user to them) matches no rule: the upstream might
// read it as a path the rules do not allow.
func RequestAllowed(rules []RequestRule, method string, u *url.URL) bool {
	if len(rules) == 0 {
		return true
	}
	urlPath := u.Path
	raw := strings.ToLower(u.EscapedPath())
	if !strings.HasPrefix(urlPath, "/") || !cleanPath(urlPath) || strings.ContainsAny(urlPath, "\\;") ||
		strings.Contains(raw, "%2f") || strings.Contains(raw, "%5c") || strings.Contains(raw, "%3b") {
		return false
	}
	for _, r := range rules {
		if len(r.Methods) > 0 && !slices.Contains(r.Methods, method) {
			continue
		}
		if len(r.Paths) == 0 {
			return true
		}
		for _, p := range r.Paths {
			if prefix, ok := strings.CutSuffix(p, "*"); ok {
				if strings.HasPrefix(urlPath, prefix) {
					return true
				}
			} else if urlPath == p {
				return true
			}
		}
	}
	return false
}

// RequestRulesEqual reports whether two rule lists are the same.
func RequestRulesEqual(a, b []RequestRule) bool {
	return slices.EqualFunc(a, b, func(x, y RequestRule) bool {
		return x.Host == y.Host && slices.Equal(x.Methods, y.Methods) && slices.Equal(x.Paths, y.Paths)
	})
}

func cloneRequestRules(in []RequestRule) []RequestRule {
	if in == nil {
		return nil
	}
	out := make([]RequestRule, len(in))
	for i, r := range in {
		out[i] = RequestRule{Host: r.Host, Methods: slices.Clone(r.Methods), Paths: slices.Clone(r.Paths)}
	}
	return out
}
