package e2bapi_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/nsdial"
)

// TestRequestRules: request rules given in the E2B create body
// (network.requests, cube's extension) reach the node's egress proxy: a
// process in the sandbox gets GET under /repos/ through and is answered
// 403 by the proxy for another method or path, which the upstream never
// sees. A network update without requests keeps them; one with
// "requests": [] removes them, after which the same refused requests
// reach the upstream (the control). A bad rule is a 400 naming its field.
func TestRequestRules(t *testing.T) {
	m := mastertest.StartMaster(t, "")
	node := mastertest.StartNode(t, m, "busybox")
	w := nettest.NewWorld(t)
	api := w.Addrs[1]
	up := w.ServeDNS(t, map[string][]netip.Addr{"api.test": {api}})
	ca := nettest.NewTestCA(t, "world-ca")
	cert := ca.Issue(t, "api.test")
	web := w.ServeWeb(t, func(string) *tls.Certificate { return &cert })
	node.Stop()
	agent := node.Env.StartNetworkAgent(t, nettest.Options{DNSUpstreams: []string{up.String()}, UpstreamCA: ca.File})
	node.Start()
	m.WaitHealthy(t, node)
	a := m.API(teamKey(t, m, "team-a", false, nil))
	var created []string
	t.Cleanup(func() {
		for _, id := range created {
			a.Do(t, "DELETE", "/sandboxes/"+id, nil, nil)
		}
		node.Stop()
	})
	no := false
	rules := []map[string]any{{"host": "api.test", "methods": []string{"get"}, "paths": []string{"/repos/*"}}}
	create := func(reqs any) *mastertest.Response {
		var sb sandboxResp
		r := a.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "timeout": 300,
			"allow_internet_access": &no, "network": map[string]any{"allowOut": []string{"api.test"}, "requests": reqs}}, &sb)
		if sb.SandboxID != "" {
			created = append(created, sb.SandboxID)
		}
		return r
	}

	r := create([]map[string]any{{"host": "api.test", "paths": []string{"/repos/../user"}}})
	if _, msg := r.Error(); r.StatusCode != http.StatusBadRequest || !strings.Contains(msg, "network.requests[0].paths[0]") {
		t.Fatalf("a rule with an unclean path: %d %s, want 400 naming the field", r.StatusCode, r.Body)
	}
	t.Logf("a bad rule: %d %s", r.StatusCode, r.Body)
	if r := create(rules); r.StatusCode != http.StatusCreated {
		t.Fatalf("create: %d %s", r.StatusCode, r.Body)
	}
	id := created[len(created)-1]
	rec, err := node.Svc.Get(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(agent.Agent.EgressCA()) {
		t.Fatal("the node's egress CA does not parse")
	}
	// do sends method path from the sandbox's network namespace, trusting
	// the egress CA as its processes do; it returns the status and
	// whether the upstream received the request.
	do := func(method, path string) (int, bool) {
		t.Helper()
		n := len(web.Requests())
		c, err := nsdial.DialContext(context.Background(), fmt.Sprintf("/proc/%d/ns/net", rec.Container.PID), "tcp4", netip.AddrPortFrom(api, 443).String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		tc := tls.Client(c, &tls.Config{ServerName: "api.test", RootCAs: roots})
		req, _ := http.NewRequest(method, "https://api.test"+path, nil)
		if err := req.Write(tc); err != nil {
			t.Fatalf("request: %v", err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(tc), req)
		if err != nil {
			t.Fatalf("response: %v", err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		for _, got := range web.Requests()[n:] {
			if got.Method == method && got.Path == path {
				return resp.StatusCode, true
			}
		}
		return resp.StatusCode, false
	}
	refused := [][2]string{{"POST", "/repos/cube"}, {"GET", "/user"}}
	expect := func(when string, wantRefused bool) {
		t.Helper()
		if code, seen := do("GET", "/repos/cube"); code != http.StatusOK || !seen {
			t.Fatalf("%s: GET /repos/cube: %d (upstream saw it: %v)", when, code, seen)
		}
		for _, p := range refused {
			code, seen := do(p[0], p[1])
			if wantRefused && (code != http.StatusForbidden || seen) {
				t.Fatalf("%s: %s %s: %d (upstream saw it: %v), want the proxy's 403", when, p[0], p[1], code, seen)
			}
			if !wantRefused && (code != http.StatusOK || !seen) {
				t.Fatalf("%s: %s %s: %d (upstream saw it: %v), want the upstream's 200", when, p[0], p[1], code, seen)
			}
			t.Logf("%s: %s %s: %d (upstream saw it: %v)", when, p[0], p[1], code, seen)
		}
	}
	expect("created with the rule", true)
	update := func(body map[string]any) {
		t.Helper()
		if r := a.Do(t, "PUT", "/sandboxes/"+id+"/network", body, nil); r.StatusCode != http.StatusNoContent {
			t.Fatalf("network update: %d %s", r.StatusCode, r.Body)
		}
	}
	update(map[string]any{"allow_internet_access": false, "allowOut": []string{"api.test"}})
	expect("after an update without requests", true)
	update(map[string]any{"allow_internet_access": false, "allowOut": []string{"api.test"}, "requests": []any{},
		"credentials": []map[string]string{{"host": "api.test", "header": "X-Control", "value": "1"}}})
	expect(`control: after "requests": [] (terminated by a credential rule)`, false)
}
