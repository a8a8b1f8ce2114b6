package agent_test

import (
	"crypto/tls"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/network/agent"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/pki"
)

// TestHealthListenerLocalByDefault: api.http defaults to loopback, and the
// network-agent process refuses to start with api.http on every interface
// without [tls], naming the setting. Control: the same address with [tls]
// starts, and serves /healthz to a caller with a certificate of the
// cluster CA but not to one without.
func TestHealthListenerLocalByDefault(t *testing.T) {
	def, err := agent.LoadConfig("")
	if err != nil {
		t.Fatal(err)
	}
	if def.API.HTTP != "127.0.0.1:19090" {
		t.Fatalf("default api.http %q, want 127.0.0.1:19090", def.API.HTTP)
	}

	e := nettest.NewProcessEnv(t, nettest.Options{})
	port := freePort(t)
	e.Config.API.HTTP = "0.0.0.0:" + port
	p := e.SpawnProcess(t, "")
	if !p.Exited(30 * time.Second) {
		t.Fatal("network-agent with api.http on every interface and no [tls] kept running")
	}
	if !strings.Contains(p.Output(), `api.http = \"0.0.0.0:`+port+`\"`) || !strings.Contains(p.Output(), "serves no TLS") {
		t.Fatalf("network-agent exited without naming api.http:\n%s", p.Output())
	}
	t.Log("refused: api.http on every interface without [tls]")

	ca, err := pki.NewCA("test cluster")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	files, err := ca.Issue(dir, "node", "node-1", pki.RoleNode, "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	e.Config.TLS = files
	e.StartProcess(t, "")
	// The node's own certificate is of the cluster but not of a role that
	// may read the listener (master, admin); an operator's is.
	nodeTC, err := files.Client("tls")
	if err != nil {
		t.Fatal(err)
	}
	adminFiles, err := ca.Issue(dir, "admin", "admin", pki.RoleAdmin)
	if err != nil {
		t.Fatal(err)
	}
	tc, err := adminFiles.Client("tls")
	if err != nil {
		t.Fatal(err)
	}
	get := func(tc *tls.Config) (int, error) {
		hc := &http.Client{Transport: &http.Transport{TLSClientConfig: tc}, Timeout: 5 * time.Second}
		defer hc.CloseIdleConnections()
		resp, err := hc.Get("https://127.0.0.1:" + port + "/healthz")
		if err != nil {
			return 0, err
		}
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	anon := tc.Clone()
	anon.Certificates = nil
	if code, err := get(anon); err == nil {
		t.Fatalf("/healthz served (%d) to a caller without a certificate", code)
	} else {
		t.Logf("caller without a certificate: %v", err)
	}
	if code, err := get(nodeTC); err != nil || code != http.StatusForbidden {
		t.Fatalf("/healthz with a node's certificate: %d, %v, want 403", code, err)
	}
	t.Log("caller with a node's certificate: 403")
	if code, err := get(tc); err != nil || code != http.StatusNoContent {
		t.Fatalf("control: /healthz with the cluster's admin certificate: %d, %v", code, err)
	}
	t.Log("control: /healthz with the cluster's admin certificate: 204")
}

// freePort is a TCP port nothing listens on right now.
func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	_, port, _ := net.SplitHostPort(l.Addr().String())
	return port
}
