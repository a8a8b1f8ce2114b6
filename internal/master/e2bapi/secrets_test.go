package e2bapi_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/nsdial"
)

// TestSecrets: a team's secret, stored through POST /secrets, is injected
// by the node's egress proxy for a credential rule that names it; the
// catalog's files never hold its value (its name, the control, is found
// by the same search); listings give names only; another team cannot use
// it, see it or change it (404 and a 400 naming its own team, while team
// A's identical create is the control); an unknown name is a 400 that
// says so; a replaced value reaches a running sandbox at its next network
// update; a deleted secret can no longer be named.
func TestSecrets(t *testing.T) {
	m := mastertest.StartMaster(t, "")
	node := mastertest.StartNode(t, m, "busybox")
	w := nettest.NewWorld(t)
	api := w.Addrs[1]
	up := w.ServeDNS(t, map[string][]netip.Addr{"secret.test": {api}})
	ca := nettest.NewTestCA(t, "world-ca")
	cert := ca.Issue(t, "secret.test")
	web := w.ServeWeb(t, func(string) *tls.Certificate { return &cert })
	// The node again, now with a network-agent (the egress proxy).
	node.Stop()
	agent := node.Env.StartNetworkAgent(t, nettest.Options{DNSUpstreams: []string{up.String()}, UpstreamCA: ca.File})
	node.Start()
	m.WaitHealthy(t, node)
	a := m.API(teamKey(t, m, "team-a", false, nil))
	b := m.API(teamKey(t, m, "team-b", false, nil))
	var created []string
	// Before the agent's cleanup (which wants every slot released).
	t.Cleanup(func() {
		for _, id := range created {
			a.Do(t, "DELETE", "/sandboxes/"+id, nil, nil)
		}
		node.Stop()
	})

	stamp := time.Now().UnixNano()
	name := fmt.Sprintf("openai-%d", stamp)
	secret := fmt.Sprintf("Bearer sk-s3cr3t-%d", stamp)
	if r := a.Do(t, "POST", "/secrets", map[string]string{"name": name, "value": secret}, nil); r.StatusCode != http.StatusCreated || bytes.Contains(r.Body, []byte(secret)) {
		t.Fatalf("create secret: %d %s", r.StatusCode, r.Body)
	}
	if r := a.Do(t, "POST", "/secrets", map[string]string{"name": name, "value": "x"}, nil); r.StatusCode != http.StatusConflict {
		t.Fatalf("the same name again: %d %s, want 409", r.StatusCode, r.Body)
	}

	t.Run("listings give names only, each team its own", func(t *testing.T) {
		ra := a.Do(t, "GET", "/secrets", nil, nil)
		rb := b.Do(t, "GET", "/secrets", nil, nil)
		if ra.StatusCode != 200 || !bytes.Contains(ra.Body, []byte(`"`+name+`"`)) || bytes.Contains(ra.Body, []byte("s3cr3t")) {
			t.Fatalf("team A's list: %d %s", ra.StatusCode, ra.Body)
		}
		if rb.StatusCode != 200 || bytes.Contains(rb.Body, []byte(name)) {
			t.Fatalf("team B's list: %d %s", rb.StatusCode, rb.Body)
		}
		t.Logf("team A lists %s; team B lists %s", ra.Body, rb.Body)
	})

	t.Run("the catalog holds the value sealed only", func(t *testing.T) {
		files, _ := filepath.Glob(filepath.Join(m.Dir, "catalog.db*")) // the database, its WAL
		var all []byte
		for _, f := range files {
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			all = append(all, data...)
		}
		if bytes.Contains(all, []byte("sk-s3cr3t")) {
			t.Fatalf("the secret's value is in the catalog's files in clear (%v)", files)
		}
		if !bytes.Contains(all, []byte(name)) {
			t.Fatalf("control: the secret's name is not in the catalog's files either (%v, %d bytes): the search proves nothing", files, len(all))
		}
		t.Logf("%d bytes of %v: the name found, the value not", len(all), files)
	})

	network := func(ref string) map[string]any {
		return map[string]any{"allowOut": []string{"secret.test"},
			"credentials": []map[string]string{{"host": "secret.test", "header": "Authorization", "secretName": ref}}}
	}
	no := false
	create := func(c *mastertest.Client, ref string) *mastertest.Response {
		var sb sandboxResp
		r := c.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "timeout": 300,
			"allow_internet_access": &no, "network": network(ref)}, &sb)
		if sb.SandboxID != "" {
			created = append(created, sb.SandboxID)
		}
		return r
	}

	t.Run("another team's secret and an unknown name are refused", func(t *testing.T) {
		r := create(b, name)
		if _, msg := r.Error(); r.StatusCode != http.StatusBadRequest || !strings.Contains(msg, `no secret named "`+name+`" in team "team-b"`) {
			t.Fatalf("team B naming team A's secret: %d %s", r.StatusCode, r.Body)
		}
		t.Logf("team B naming team A's secret: %d %s", r.StatusCode, r.Body)
		r = create(a, "nope")
		if _, msg := r.Error(); r.StatusCode != http.StatusBadRequest || !strings.Contains(msg, `network.credentials[0].secretName: no secret named "nope"`) {
			t.Fatalf("unknown name: %d %s", r.StatusCode, r.Body)
		}
		t.Logf("unknown name: %d %s", r.StatusCode, r.Body)
		for _, c := range []struct{ method, body string }{{"PUT", `{"value": "stolen"}`}, {"DELETE", ""}} {
			var body any
			if c.body != "" {
				body = c.body
			}
			if r := b.Do(t, c.method, "/secrets/"+name, body, nil); r.StatusCode != http.StatusNotFound {
				t.Fatalf("team B %s of team A's secret: %d %s, want 404", c.method, r.StatusCode, r.Body)
			}
		}
		if r := a.Do(t, "POST", "/secrets", map[string]string{"name": "x", "value": "a\nb"}, nil); r.StatusCode != http.StatusBadRequest {
			t.Fatalf("a value with a line break: %d %s, want 400", r.StatusCode, r.Body)
		}
	})

	// The control of the refusals above and the injection: team A's
	// create with the same body.
	r := create(a, name)
	if r.StatusCode != http.StatusCreated {
		t.Fatalf("team A naming its own secret: %d %s", r.StatusCode, r.Body)
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
	// get sends a request from the sandbox's network namespace (as a
	// process in it would, trusting the egress CA) and returns the
	// Authorization the upstream saw.
	get := func() string {
		t.Helper()
		c, err := nsdial.DialContext(context.Background(), fmt.Sprintf("/proc/%d/ns/net", rec.Container.PID), "tcp4", netip.AddrPortFrom(api, 443).String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		tc := tls.Client(c, &tls.Config{ServerName: "secret.test", RootCAs: roots})
		req, _ := http.NewRequest(http.MethodGet, "https://secret.test/", nil)
		if err := req.Write(tc); err != nil {
			t.Fatalf("request: %v", err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(tc), req)
		if err != nil {
			t.Fatalf("response: %v", err)
		}
		resp.Body.Close()
		reqs := web.Requests()
		return reqs[len(reqs)-1].Header.Get("Authorization")
	}
	if got := get(); got != secret {
		t.Fatalf("upstream saw Authorization %q, want the secret", got)
	}
	t.Logf("a rule naming %s: the upstream received its value", name)

	t.Run("a replaced value reaches the sandbox at its next network update", func(t *testing.T) {
		rotated := secret + "-rotated"
		if r := a.Do(t, "PUT", "/secrets/"+name, map[string]string{"value": rotated}, nil); r.StatusCode != http.StatusOK {
			t.Fatalf("replace: %d %s", r.StatusCode, r.Body)
		}
		if r := a.Do(t, "PUT", "/sandboxes/"+id+"/network", map[string]any{"allow_internet_access": false, "allowOut": []string{"secret.test"}}, nil); r.StatusCode != http.StatusNoContent {
			t.Fatalf("network update: %d %s", r.StatusCode, r.Body)
		}
		if got := get(); got != rotated {
			t.Fatalf("after the update the upstream saw %q, want the replaced value", got)
		}
		t.Logf("after PUT /secrets/%s and a network update the upstream received the new value", name)
	})

	t.Run("a deleted secret cannot be named", func(t *testing.T) {
		if r := a.Do(t, "DELETE", "/secrets/"+name, nil, nil); r.StatusCode != http.StatusNoContent {
			t.Fatalf("delete: %d %s", r.StatusCode, r.Body)
		}
		if r := create(a, name); r.StatusCode != http.StatusBadRequest {
			t.Fatalf("create naming a deleted secret: %d %s, want 400", r.StatusCode, r.Body)
		}
	})
}
