package serve_test

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/cubesandbox/cube/internal/pki"
	"github.com/cubesandbox/cube/internal/serve"
)

// TestPlaintextOnlyOnLoopback: a listener that serves no TLS is refused
// on any address that is not loopback, with an error naming the setting;
// the same address is allowed when the listener serves TLS (the control:
// the refusal is about TLS, not the address being unusable).
func TestPlaintextOnlyOnLoopback(t *testing.T) {
	for _, c := range []struct {
		addr    string
		secured bool
		refused bool
	}{
		{"0.0.0.0:0", false, true},
		{":0", false, true},
		{"0.0.0.0:0", true, false}, // control
		{":0", true, false},        // control
		{"127.0.0.1:0", false, false},
		{"localhost:0", false, false},
	} {
		l, err := serve.ListenTCP("api.test", "[tls] cert, key and ca", c.addr, c.secured)
		switch {
		case c.refused && err == nil:
			l.Close()
			t.Errorf("%s without TLS: listening on %s, want a refusal", c.addr, l.Addr())
		case c.refused:
			if !errors.Is(err, serve.ErrNotLocal) || !strings.Contains(err.Error(), "api.test") || !strings.Contains(err.Error(), "[tls] cert, key and ca") {
				t.Errorf("%s without TLS: %v, want ErrNotLocal naming api.test and [tls]", c.addr, err)
			}
			t.Logf("%s, no TLS: refused: %v", c.addr, err)
			// The refused listener was closed: its port is not held.
		case err != nil:
			t.Errorf("%s (TLS %v): %v", c.addr, c.secured, err)
		default:
			t.Logf("%s (TLS %v): listening on %s", c.addr, c.secured, l.Addr())
			l.Close()
		}
	}
}

// TestMutualTLS: a TCP listener with a MutualServer config admits only
// callers presenting a certificate the cluster CA signed. Probes: no TLS,
// TLS without a certificate, a certificate of another CA, and a client
// that trusts another CA (a server it should not talk to): all fail. The
// control, the same call with the cluster's client certificate, succeeds.
func TestMutualTLS(t *testing.T) {
	dir := t.TempDir()
	ca, err := pki.NewCA("test cluster")
	if err != nil {
		t.Fatal(err)
	}
	srvFiles, err := ca.Issue(dir, "server", "server", pki.RoleNode, "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	cliFiles, err := ca.Issue(dir, "client", "client", pki.RoleMaster)
	if err != nil {
		t.Fatal(err)
	}
	other, err := pki.NewCA("another cluster")
	if err != nil {
		t.Fatal(err)
	}
	otherFiles, err := other.Issue(t.TempDir(), "client", "client", pki.RoleMaster, "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	mtls, err := srvFiles.MutualServer("tls")
	if err != nil {
		t.Fatal(err)
	}

	g := &serve.Group{Grace: time.Second}
	gl, err := g.TCP("api.grpc", "[tls]", "0.0.0.0:0", mtls) // beyond loopback: allowed with TLS
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	healthpb.RegisterHealthServer(gs, health.NewServer())
	g.GRPC("test API", gs, gl)
	hl, err := g.TCP("api.http", "[tls]", "127.0.0.1:0", mtls)
	if err != nil {
		t.Fatal(err)
	}
	g.HTTP("test metrics", http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusTeapot) }), hl)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- g.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	_, port, _ := net.SplitHostPort(gl.Addr().String())
	grpcAddr := "127.0.0.1:" + port

	client := func(f serve.TLSFiles) *tls.Config {
		tc, err := f.Client("tls")
		if err != nil {
			t.Fatal(err)
		}
		return tc
	}
	good := client(cliFiles)
	noCert := good.Clone()
	noCert.Certificates = nil
	otherCert := client(otherFiles)
	otherCert.RootCAs = good.RootCAs // trusts the server; presents a foreign certificate
	wrongTrust := good.Clone()
	wrongTrust.RootCAs = client(otherFiles).RootCAs

	check := func(creds credentials.TransportCredentials) error {
		conn, err := grpc.NewClient(grpcAddr, grpc.WithTransportCredentials(creds))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
		defer ccancel()
		_, err = healthpb.NewHealthClient(conn).Check(cctx, &healthpb.HealthCheckRequest{})
		return err
	}
	for _, c := range []struct {
		name  string
		creds credentials.TransportCredentials
		ok    bool
	}{
		{"plaintext", insecure.NewCredentials(), false},
		{"TLS without a client certificate", credentials.NewTLS(noCert), false},
		{"a certificate of another CA", credentials.NewTLS(otherCert), false},
		{"a client trusting another CA", credentials.NewTLS(wrongTrust), false},
		{"control: the cluster's client certificate", credentials.NewTLS(good), true},
	} {
		err := check(c.creds)
		if c.ok != (err == nil) {
			t.Errorf("gRPC, %s: err %v, want success %v", c.name, err, c.ok)
			continue
		}
		t.Logf("gRPC, %s: %v", c.name, err)
	}

	get := func(tc *tls.Config) (int, error) {
		hc := &http.Client{Transport: &http.Transport{TLSClientConfig: tc, ForceAttemptHTTP2: true}, Timeout: 5 * time.Second}
		defer hc.CloseIdleConnections()
		resp, err := hc.Get("https://" + hl.Addr().String() + "/metrics")
		if err != nil {
			return 0, err
		}
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	if _, err := get(noCert); err == nil {
		t.Error("HTTP without a client certificate was served")
	} else {
		t.Logf("HTTP without a client certificate: %v", err)
	}
	if code, err := get(good); err != nil || code != http.StatusTeapot {
		t.Errorf("control: HTTP with the cluster's certificate: %d, %v", code, err)
	}
	resp, err := http.Get("http://" + hl.Addr().String() + "/metrics")
	if err == nil {
		resp.Body.Close()
		if resp.StatusCode == http.StatusTeapot {
			t.Error("plaintext HTTP was served by the TLS listener")
		}
	}
}
