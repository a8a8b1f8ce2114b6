package agent_test

import (
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/network/audit"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/network/policy"
)

// exchange writes raw (a request written by hand, so it goes out as
// given) on w and reads one response: status and body.
func exchange(w *webConn, raw string) (int, string, error) {
	_ = w.c.SetDeadline(time.Now().Add(webWait))
	if _, err := io.WriteString(w.c, raw); err != nil {
		return 0, "", err
	}
	resp, err := http.ReadResponse(w.br, nil)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// since returns what the upstream got after its first n requests.
func since(web *nettest.Web, n int) []nettest.WebRequest { return web.Requests()[n:] }

// TestEgressRequestRulesHold: request rules (GET under /repos/ on
// api.allowed.test) hold against the requests that would get past them:
// a protocol switch other than websocket (h2c: the upstream would then
// take requests the proxy cannot read), a path with ";" (/repos/..;/user
// is /user to Tomcat and Spring), method and path override headers, and
// a request head over 64 KiB (answered 431, so a sandbox cannot make the
// proxy hold or audit unbounded headers). Each row runs with the rules
// (stopped) and as a control without them (the host terminated by a
// credential rule only, or for the head size a sandbox without the
// proxy): there the same probe reaches the upstream.
func TestEgressRequestRulesHold(t *testing.T) {
	ew := newEgressWorld(t)
	a := ew.withProxy.Agent
	const host = "api.allowed.test"
	tlsOpts := webOpts{useTLS: true, sni: host} // an attacker's client: verifies nothing
	withRules := ew.domains
	withRules.Requests = []policy.RequestRule{{Host: host, Methods: []string{"GET"}, Paths: []string{"/repos/*"}}}
	control := ew.domains
	control.Credentials = []policy.Credential{{Host: host, Header: "X-Control", Value: "1"}}
	t.Cleanup(func() { update(t, a, "sb-egress", ew.domains) })

	h2c := "GET /repos/x HTTP/1.1\r\nHost: " + host + "\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n" +
		"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"
	after := "GET /user HTTP/1.1\r\nHost: " + host + "\r\n\r\n"
	overrides := "GET /repos/x HTTP/1.1\r\nHost: " + host + "\r\nX-HTTP-Method-Override: DELETE\r\nX-HTTP-Method: DELETE\r\n" +
		"X-Method-Override: DELETE\r\nX-Original-URL: /user\r\nX-Rewrite-URL: /user\r\n\r\n"
	overrideHeaders := []string{"X-Http-Method-Override", "X-Http-Method", "X-Method-Override", "X-Original-Url", "X-Rewrite-Url"}
	padded := func(n int) string {
		return "GET /repos/x HTTP/1.1\r\nHost: " + host + "\r\nX-Pad: " + strings.Repeat("a", n) + "\r\n\r\n"
	}

	// h2c: refused under the rules (403, nothing upstream); the control
	// switches and then carries GET /user.
	update(t, a, "sb-egress", withRules)
	w, err := openWeb(ew.sb.NetNS, ew.api, tlsOpts)
	if err != nil {
		t.Fatal(err)
	}
	n := len(ew.web.Requests())
	code, body, err := exchange(w, h2c)
	w.Close()
	if err != nil || code != http.StatusForbidden || !strings.Contains(body, `upgrade to "h2c" refused`) || len(since(ew.web, n)) != 0 {
		t.Fatalf("h2c under rules: %d %q %v, upstream got %+v; want the proxy's 403", code, body, err, since(ew.web, n))
	}
	t.Logf("h2c upgrade under rules: %d %q", code, strings.TrimSpace(body))
	for deadline := time.Now().Add(3 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if slices.ContainsFunc(readAudit(t, a.AuditPath("sb-egress")), func(e audit.Event) bool {
			return e.Kind == audit.KindConnect && e.Verdict == audit.Denied && strings.Contains(e.Reason, `upgrade to "h2c" refused`)
		}) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no denied audit event for the h2c upgrade")
		}
	}
	t.Log("audit: the h2c refusal is a denied connect event")
	// websocket on an allowed path switches (the upgrade request is the
	// one the rules check); on a refused path it is refused.
	w, err = openWeb(ew.sb.NetNS, ew.api, tlsOpts)
	if err != nil {
		t.Fatal(err)
	}
	code, _, err = exchange(w, strings.ReplaceAll(h2c, "h2c", "websocket"))
	w.Close()
	if err != nil || code != http.StatusSwitchingProtocols {
		t.Fatalf("websocket to /repos/x under rules: %d %v, want 101", code, err)
	}
	w, err = openWeb(ew.sb.NetNS, ew.api, tlsOpts)
	if err != nil {
		t.Fatal(err)
	}
	n = len(ew.web.Requests())
	code, body, err = exchange(w, "GET /user HTTP/1.1\r\nHost: "+host+"\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
	w.Close()
	if err != nil || code != http.StatusForbidden || len(since(ew.web, n)) != 0 {
		t.Fatalf("websocket to /user under rules: %d %q %v, want the proxy's 403", code, body, err)
	}
	t.Log("websocket upgrade under rules: 101 on /repos/x, 403 on /user")
	update(t, a, "sb-egress", control)
	w, err = openWeb(ew.sb.NetNS, ew.api, tlsOpts)
	if err != nil {
		t.Fatal(err)
	}
	n = len(ew.web.Requests())
	code, _, err = exchange(w, h2c)
	if err != nil || code != http.StatusSwitchingProtocols {
		w.Close()
		t.Fatalf("control h2c: %d %v, want the upstream's 101", code, err)
	}
	code, body, err = exchange(w, after)
	w.Close()
	got := since(ew.web, n)
	if err != nil || code != http.StatusOK || len(got) != 2 || got[1].Path != "/user" || got[1].Upgraded != "h2c" {
		t.Fatalf("control h2c then GET /user: %d %q %v, upstream got %+v", code, body, err, got)
	}
	t.Logf("control without request rules: h2c switched, then GET /user reached the upstream: %q", strings.TrimSpace(body))

	// ";" in a path segment.
	for _, pol := range []struct {
		name string
		spec policy.Spec
		want int
	}{{"rules", withRules, http.StatusForbidden}, {"control", control, http.StatusOK}} {
		update(t, a, "sb-egress", pol.spec)
		n = len(ew.web.Requests())
		code, body, err = request(ew.sb.NetNS, ew.api, tlsOpts, "GET", host, "/repos/..;/user")
		if err != nil || code != pol.want || (pol.want == http.StatusOK) != (len(since(ew.web, n)) == 1) {
			t.Fatalf("%s: GET /repos/..;/user: %d %q %v, want %d", pol.name, code, body, err, pol.want)
		}
		t.Logf("%s: GET /repos/..;/user: %d", pol.name, code)
	}

	// Override headers: stripped under rules, passed in the control.
	for _, pol := range []struct {
		name  string
		spec  policy.Spec
		strip bool
	}{{"rules", withRules, true}, {"control", control, false}} {
		update(t, a, "sb-egress", pol.spec)
		w, err := openWeb(ew.sb.NetNS, ew.api, tlsOpts)
		if err != nil {
			t.Fatal(err)
		}
		n = len(ew.web.Requests())
		code, _, err = exchange(w, overrides)
		w.Close()
		got := since(ew.web, n)
		if err != nil || code != http.StatusOK || len(got) != 1 {
			t.Fatalf("%s: overrides: %d %v %+v", pol.name, code, err, got)
		}
		for _, h := range overrideHeaders {
			if (got[0].Header.Get(h) == "") != pol.strip {
				t.Fatalf("%s: %s reached the upstream as %q (strip %v)", pol.name, h, got[0].Header.Get(h), pol.strip)
			}
		}
		t.Logf("%s: override headers stripped %v", pol.name, pol.strip)
	}

	// Request head size: 70 KiB is answered 431 by the proxy (plain HTTP
	// and terminated TLS), 60 KiB passes; without the proxy 70 KiB
	// reaches the upstream.
	update(t, a, "sb-egress", withRules)
	for _, o := range []webOpts{{}, tlsOpts} {
		for _, c := range []struct{ pad, want int }{{70 << 10, http.StatusRequestHeaderFieldsTooLarge}, {60 << 10, http.StatusOK}} {
			w, err := openWeb(ew.sb.NetNS, ew.api, o)
			if err != nil {
				t.Fatal(err)
			}
			code, body, err = exchange(w, padded(c.pad))
			w.Close()
			if err != nil || code != c.want {
				t.Fatalf("head with %d B of header (tls %v): %d %q %v, want %d", c.pad, o.useTLS, code, body, err, c.want)
			}
			t.Logf("head with %d B of header (tls %v): %d", c.pad, o.useTLS, code)
		}
	}
	w, err = openWeb(ew.sb0.NetNS, ew.api, webOpts{})
	if err != nil {
		t.Fatal(err)
	}
	code, _, err = exchange(w, padded(70<<10))
	w.Close()
	if err != nil || code != http.StatusOK {
		t.Fatalf("control without the proxy: 70 KiB head: %d %v", code, err)
	}
	t.Log("control without the proxy: a 70 KiB head reaches the upstream")
}

// TestEgressRequestRulesBind: request rules on api.allowed.test bind
// every connection to its address, however the connection names itself:
// with internet allowed or a CIDR allow covering the address, TLS with
// no SNI or an unrelated one, and plain HTTP with an IP literal Host,
// are refused; TLS with another name of the same address (secret.test,
// as on a CDN) is terminated and a request inside for Host
// api.allowed.test refused. Each probe is GET /user, which the rules
// refuse; the control is the same policy without the request rules,
// where it reaches the upstream. A name that shares the address still
// works for its own requests.
func TestEgressRequestRulesBind(t *testing.T) {
	ew := newEgressWorld(t)
	a := ew.withProxy.Agent
	const host = "api.allowed.test"
	yes, no := true, false
	rules := []policy.RequestRule{{Host: host, Methods: []string{"GET"}, Paths: []string{"/repos/*"}}}
	t.Cleanup(func() { update(t, a, "sb-egress", ew.domains) })
	cidr := netip.PrefixFrom(ew.api, 32).String()
	probe := func(o webOpts, hostHeader string) (int, string, error) {
		w, err := openWeb(ew.sb.NetNS, ew.api, o)
		if err != nil {
			return 0, "", err
		}
		defer w.Close()
		return exchange(w, "GET /user HTTP/1.1\r\nHost: "+hostHeader+"\r\n\r\n")
	}
	for _, r := range []struct {
		name string
		spec policy.Spec
		o    webOpts
		hdr  string
	}{
		{"internet, TLS without SNI", policy.Spec{AllowInternet: &yes}, webOpts{useTLS: true}, host},
		{"internet, TLS with SNI evil.test", policy.Spec{AllowInternet: &yes}, webOpts{useTLS: true, sni: "evil.test"}, host},
		{"internet, HTTP with an IP Host", policy.Spec{AllowInternet: &yes}, webOpts{}, ew.api.String()},
		{"CIDR allow, TLS without SNI", policy.Spec{AllowInternet: &no, Allow: []string{cidr}}, webOpts{useTLS: true}, host},
		{"co-hosted name, TLS SNI secret.test, Host " + host, policy.Spec{AllowInternet: &no, Allow: []string{host, "secret.test"}},
			webOpts{useTLS: true, sni: "secret.test"}, host},
	} {
		spec := r.spec
		spec.Requests = rules
		update(t, a, "sb-egress", spec)
		n := len(ew.web.Requests())
		code, body, err := probe(r.o, r.hdr)
		if got := since(ew.web, n); (err == nil && code == http.StatusOK) || len(got) != 0 {
			t.Fatalf("%s: %d %q %v, upstream got %+v; want it stopped", r.name, code, body, err, got)
		}
		t.Logf("%s, with rules: stopped (%d %v)", r.name, code, err)
		update(t, a, "sb-egress", r.spec)
		n = len(ew.web.Requests())
		code, body, err = probe(r.o, r.hdr)
		if got := since(ew.web, n); err != nil || code != http.StatusOK || len(got) != 1 || got[0].Path != "/user" {
			t.Fatalf("control %s: %d %q %v, upstream got %+v; want it through", r.name, code, body, err, got)
		}
		t.Logf("%s, control without rules: %d %q", r.name, code, strings.TrimSpace(body))
	}
	// Under the rules: the co-hosted name's own requests pass (the
	// proxy terminates them and checks Host), as do the rule host's
	// allowed ones.
	update(t, a, "sb-egress", policy.Spec{AllowInternet: &yes, Requests: rules})
	for _, c := range []struct{ sni, hostHdr, target string }{{"secret.test", "secret.test", "/user"}, {host, host, "/repos/x"}} {
		w, err := openWeb(ew.sb.NetNS, ew.api, webOpts{useTLS: true, sni: c.sni})
		if err != nil {
			t.Fatal(err)
		}
		code, body, err := exchange(w, fmt.Sprintf("GET %s HTTP/1.1\r\nHost: %s\r\n\r\n", c.target, c.hostHdr))
		w.Close()
		if err != nil || code != http.StatusOK || !strings.Contains(body, "host="+c.hostHdr) {
			t.Fatalf("SNI %s GET %s: %d %q %v", c.sni, c.target, code, body, err)
		}
		t.Logf("under rules, SNI %s GET %s: %d", c.sni, c.target, code)
	}
}
