package agent_test

import (
	"crypto/x509"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/network/audit"
	"github.com/cubesandbox/cube/internal/network/policy"
)

// request sends one request (method, raw path) for host on a new
// connection and returns the status and body.
func request(ns string, dst netip.Addr, o webOpts, method, host, target string) (int, string, error) {
	w, err := openWeb(ns, dst, o)
	if err != nil {
		return 0, "", err
	}
	defer w.Close()
	_ = w.c.SetDeadline(time.Now().Add(webWait))
	// Written by hand: the target goes out as given (net/http would
	// clean a path such as /repos/../user).
	if _, err := fmt.Fprintf(w.c, "%s %s HTTP/1.1\r\nHost: %s\r\nContent-Length: 0\r\n\r\n", method, target, host); err != nil {
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

// TestEgressRequestRules: a host with request rules (GET under /repos/ on
// api.allowed.test) gets only those requests through the proxy, over
// terminated TLS and plain HTTP; the others are answered 403 by the
// proxy, never reach the upstream, and are audited as denied. The
// control is the same host terminated by a credential rule without
// request rules: every probe reaches the upstream.
func TestEgressRequestRules(t *testing.T) {
	ew := newEgressWorld(t)
	a := ew.withProxy.Agent
	egressRoots := x509.NewCertPool()
	if !egressRoots.AppendCertsFromPEM(a.EgressCA()) {
		t.Fatal("no egress CA")
	}
	tlsOpts := webOpts{useTLS: true, sni: "api.allowed.test", roots: egressRoots}
	const host = "api.allowed.test"
	type probe struct {
		o              webOpts
		method, target string
	}
	refused := []probe{
		{tlsOpts, "POST", "/repos/cube/issues"},
		{tlsOpts, "GET", "/user"},
		{tlsOpts, "GET", "/repos/../user"},
		{tlsOpts, "GET", "/repos%2F..%2Fuser"},
		{webOpts{}, "DELETE", "/repos/cube"},
		{webOpts{}, "GET", "/user"},
	}
	passed := []probe{
		{tlsOpts, "GET", "/repos/cube/issues"},
		{webOpts{}, "GET", "/repos/cube"},
	}
	// seen: did the upstream get method target (since n requests)?
	seen := func(n int, method, target string) bool {
		for _, r := range ew.web.Requests()[n:] {
			if r.Method == method && r.Host == host && r.Path == target {
				return true
			}
		}
		return false
	}
	base := ew.domains
	withRules := base
	withRules.Requests = []policy.RequestRule{{Host: host, Methods: []string{"GET"}, Paths: []string{"/repos/*"}}}
	update(t, a, "sb-egress", withRules)
	t.Cleanup(func() { update(t, a, "sb-egress", ew.domains) })

	for _, p := range passed {
		n := len(ew.web.Requests())
		code, body, err := request(ew.sb.NetNS, ew.api, p.o, p.method, host, p.target)
		if err != nil || code != http.StatusOK || !strings.Contains(body, "host="+host) || !seen(n, p.method, p.target) {
			t.Fatalf("allowed %s %s (tls %v): %d %q %v", p.method, p.target, p.o.useTLS, code, body, err)
		}
		t.Logf("allowed %s %s (tls %v): %d, the upstream got it", p.method, p.target, p.o.useTLS, code)
	}
	for _, p := range refused {
		n := len(ew.web.Requests())
		code, body, err := request(ew.sb.NetNS, ew.api, p.o, p.method, host, p.target)
		if err != nil || code != http.StatusForbidden || !strings.Contains(body, "request rules of "+host) {
			t.Fatalf("refused %s %s (tls %v): %d %q %v, want the proxy's 403", p.method, p.target, p.o.useTLS, code, body, err)
		}
		if got := ew.web.Requests()[n:]; len(got) != 0 {
			t.Fatalf("refused %s %s reached the upstream: %+v", p.method, p.target, got)
		}
		t.Logf("refused %s %s (tls %v): %d %q", p.method, p.target, p.o.useTLS, code, strings.TrimSpace(body))
	}
	// The audit: a denied connect event for each refusal, naming it.
	deadline := time.Now().Add(3 * time.Second)
	for _, p := range refused {
		want := fmt.Sprintf("request %s %s refused", p.method, p.target)
		for {
			i := slices.IndexFunc(readAudit(t, a.AuditPath("sb-egress")), func(e audit.Event) bool {
				return e.Kind == audit.KindConnect && e.Verdict == audit.Denied && e.Name == host && strings.Contains(e.Reason, want)
			})
			if i >= 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("no denied audit event with %q", want)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	t.Log("audit: a denied connect event names each refused request")

	// Control: the host terminated without request rules (a credential
	// rule makes the proxy terminate it the same way): every refused
	// probe reaches the upstream.
	control := base
	control.Credentials = []policy.Credential{{Host: host, Header: "X-Control", Value: "1"}}
	update(t, a, "sb-egress", control)
	for _, p := range refused {
		n := len(ew.web.Requests())
		code, body, err := request(ew.sb.NetNS, ew.api, p.o, p.method, host, p.target)
		if err != nil || code == http.StatusForbidden || !strings.Contains(body, "host="+host) || len(ew.web.Requests()) == n {
			t.Fatalf("control %s %s (tls %v): %d %q %v, want the upstream's answer", p.method, p.target, p.o.useTLS, code, body, err)
		}
		t.Logf("control without request rules: %s %s (tls %v): %d from the upstream", p.method, p.target, p.o.useTLS, code)
	}
}
