package pki_test

import (
	"crypto/tls"
	"errors"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/pki"
	"github.com/cubesandbox/cube/internal/serve"
)

// TestExpectPeer: a client made with ExpectPeer completes a handshake
// only with a server whose certificate has the role (and name) it
// expects; the control, the same client config without ExpectPeer, shakes
// hands with every server of the CA.
func TestExpectPeer(t *testing.T) {
	ca, err := pki.NewCA("test")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	issue := func(base, name string, role pki.Role) serve.TLSFiles {
		f, err := ca.Issue(dir, base, name, role, "127.0.0.1")
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	servers := map[string]serve.TLSFiles{
		"node n1": issue("n1", "n1", pki.RoleNode),
		"node n2": issue("n2", "n2", pki.RoleNode),
		"master":  issue("master", "cubemaster", pki.RoleMaster),
	}
	clientTC, err := issue("admin", "admin", pki.RoleAdmin).Client("tls")
	if err != nil {
		t.Fatal(err)
	}
	if pki.ExpectPeer(nil, "", pki.RoleNode) != nil {
		t.Fatal("ExpectPeer(nil) is not nil")
	}
	handshake := func(server serve.TLSFiles, tc *tls.Config) error {
		stc, err := server.MutualServer("tls")
		if err != nil {
			t.Fatal(err)
		}
		l, err := tls.Listen("tcp", "127.0.0.1:0", stc)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		go func() {
			c, err := l.Accept()
			if err == nil {
				_ = c.(*tls.Conn).Handshake()
				c.Close()
			}
		}()
		c, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", l.Addr().String(), tc)
		if err != nil {
			return err
		}
		return c.Close()
	}
	for _, c := range []struct {
		server, name string
		role         pki.Role
		ok           bool
	}{
		{"node n1", "n1", pki.RoleNode, true},
		{"node n2", "n1", pki.RoleNode, false},
		{"master", "n1", pki.RoleNode, false},
		{"node n1", "", pki.RoleNode, true},
		{"master", "", pki.RoleMaster, true},
		{"node n1", "", pki.RoleMaster, false},
	} {
		err := handshake(servers[c.server], pki.ExpectPeer(clientTC, c.name, c.role))
		if (err == nil) != c.ok {
			t.Errorf("server %s, expecting %s %q: %v, want ok=%v", c.server, c.role, c.name, err, c.ok)
			continue
		}
		if err := handshake(servers[c.server], clientTC); err != nil {
			t.Errorf("control: server %s without ExpectPeer: %v", c.server, err)
		}
		t.Logf("server %s, expecting %s %q: %v (control without ExpectPeer: ok)", c.server, c.role, c.name, err)
	}
	if clientTC.VerifyConnection != nil {
		t.Error("ExpectPeer changed the config it was given")
	}
}

// TestCheckPeerAndRequirePeer: the role and name checks, and the HTTP
// handler that applies them to a request's verified client certificate.
func TestCheckPeerAndRequirePeer(t *testing.T) {
	ca, err := pki.NewCA("test")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	node, err := ca.Issue(dir, "n1", "n1", pki.RoleNode, "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	admin, err := ca.Issue(dir, "admin", "admin", pki.RoleAdmin)
	if err != nil {
		t.Fatal(err)
	}
	if err := pki.CheckPeer(nil, "", pki.RoleNode); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Errorf("no certificate: %v", err)
	}
	stc, err := node.MutualServer("tls")
	if err != nil {
		t.Fatal(err)
	}
	l, err := tls.Listen("tcp", "127.0.0.1:0", stc)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: pki.RequirePeer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusNoContent)
	}), pki.RoleAdmin, pki.RoleMaster), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { srv.Close() })
	get := func(f serve.TLSFiles) int {
		tc, err := f.Client("tls")
		if err != nil {
			t.Fatal(err)
		}
		hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: tc}}
		defer hc.CloseIdleConnections()
		resp, err := hc.Get("https://" + l.Addr().String() + "/")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := get(node); code != http.StatusForbidden {
		t.Errorf("a node's certificate: %d, want 403", code)
	}
	if code := get(admin); code != http.StatusNoContent {
		t.Errorf("control: an admin's certificate: %d, want 204", code)
	}
}
