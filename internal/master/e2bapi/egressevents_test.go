package e2bapi_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/network/audit"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/nsdial"
)

// TestEgressVerdictEvents: the egress proxy's denied connections of a
// sandbox reach the master as the sandbox's events (its log through the
// E2B API, for its team's key), at most audit.NotableBurst a minute, then
// events counting the rest. The control: an allowed connection of the
// same sandbox, made first, leaves no event; another team's key cannot
// read them.
func TestEgressVerdictEvents(t *testing.T) {
	m := mastertest.StartMaster(t, "")
	node := mastertest.StartNode(t, m, "busybox")
	w := nettest.NewWorld(t)
	api, evil := w.Addrs[1], w.Addrs[0]
	up := w.ServeDNS(t, map[string][]netip.Addr{"api.test": {api}, "evil.test": {evil}})
	ca := nettest.NewTestCA(t, "world-ca")
	cert := ca.Issue(t, "api.test", "evil.test")
	w.ServeWeb(t, func(string) *tls.Certificate { return &cert })
	node.Stop()
	node.Env.StartNetworkAgent(t, nettest.Options{DNSUpstreams: []string{up.String()}, UpstreamCA: ca.File})
	node.Start()
	m.WaitHealthy(t, node)
	a := m.API(teamKey(t, m, "team-a", false, nil))
	b := m.API(teamKey(t, m, "team-b", false, nil))
	no := false
	var sb sandboxResp
	if r := a.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "timeout": 300,
		"allow_internet_access": &no, "network": map[string]any{"allowOut": []string{"api.test"}}}, &sb); r.StatusCode != http.StatusCreated {
		t.Fatalf("create: %d %s", r.StatusCode, r.Body)
	}
	t.Cleanup(func() {
		a.Do(t, "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil)
		node.Stop()
	})
	rec, err := node.Svc.Get(context.Background(), sb.SandboxID)
	if err != nil {
		t.Fatal(err)
	}
	ns := fmt.Sprintf("/proc/%d/ns/net", rec.Container.PID)
	// tlsTo opens TLS to dst:443 naming sni from the sandbox's namespace.
	tlsTo := func(dst netip.Addr, sni string) error {
		c, err := nsdial.DialContext(context.Background(), ns, "tcp4", netip.AddrPortFrom(dst, 443).String())
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(3 * time.Second))
		return tls.Client(c, &tls.Config{ServerName: sni, RootCAs: ca.Pool}).Handshake()
	}
	logs := func(c *mastertest.Client) (int, []logEntryResp) {
		t.Helper()
		var out struct {
			Logs []logEntryResp `json:"logs"`
		}
		r := c.Do(t, "GET", "/v2/sandboxes/"+sb.SandboxID+"/logs?limit=1000", nil, &out)
		return r.StatusCode, out.Logs
	}
	// The count of the suppressed ones comes with the node's report that
	// took them: a heartbeat between the probes splits it in two events.
	egress := func() (denied, other []logEntryResp, suppressed int) {
		_, all := logs(a)
		for _, e := range all {
			switch {
			case strings.HasPrefix(e.Message, "egress denied") && e.Fields["name"] == "evil.test":
				denied = append(denied, e)
			case strings.HasPrefix(e.Message, "egress: "):
				n, err := strconv.Atoi(e.Fields["suppressed"])
				if err != nil {
					t.Fatalf("suppressed count %q: %v", e.Fields["suppressed"], err)
				}
				suppressed += n
			case strings.HasPrefix(e.Message, "egress"):
				other = append(other, e)
			}
		}
		return denied, other, suppressed
	}

	if err := tlsTo(api, "api.test"); err != nil {
		t.Fatalf("control: the allowed name: %v", err)
	}
	const probes = audit.NotableBurst + 5
	for range probes {
		if err := tlsTo(evil, "evil.test"); err == nil {
			t.Fatal("evil.test: the proxy let it through")
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	var denied, other []logEntryResp
	var suppressed int
	for {
		denied, other, suppressed = egress()
		if len(denied) >= audit.NotableBurst && suppressed >= 5 || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if len(denied) != audit.NotableBurst || suppressed != 5 {
		t.Fatalf("%d denied connections: %d egress events and suppressed %d; want %d and 5", probes, len(denied), suppressed, audit.NotableBurst)
	}
	e := denied[0]
	if e.Level != "warn" || e.Fields["verdict"] != audit.Denied || e.Fields["kind"] != audit.KindConnect || !strings.Contains(e.Fields["reason"], "not allowed") {
		t.Fatalf("egress event %+v", e)
	}
	t.Logf("%d denied connections: %d events (e.g. %q %v), then counts of %d more", probes, len(denied), e.Message, e.Fields, suppressed)
	if len(other) != 0 {
		t.Fatalf("control: other egress events %+v (the allowed connection must leave none)", other)
	}
	t.Log("control: the allowed connection to api.test left no event")
	if code, _ := logs(b); code != http.StatusNotFound {
		t.Fatalf("team B reading team A's sandbox log: %d, want 404", code)
	}
}
