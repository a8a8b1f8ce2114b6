package nodetunnel

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/pki"
)

// cluster is a CA with certificates for node n1 (serving), a proxy, a
// master, another node and an operator.
type cluster struct {
	server                     *tls.Config
	proxy, master, node, admin *tls.Config
	// masterServer is a listener config holding the master's certificate:
	// valid for the CA, of the wrong role for a node listener.
	masterServer *tls.Config
}

func newCluster(t *testing.T) *cluster {
	t.Helper()
	ca, err := pki.NewCA("test CA")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	client := func(base, name string, role pki.Role) *tls.Config {
		f, err := ca.Issue(dir, base, name, role, "127.0.0.1")
		if err != nil {
			t.Fatal(err)
		}
		tc, err := f.Client("test")
		if err != nil {
			t.Fatal(err)
		}
		return tc
	}
	f, err := ca.Issue(dir, "n1", "n1", pki.RoleNode, "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	srv, err := f.MutualServer("test")
	if err != nil {
		t.Fatal(err)
	}
	mf, err := ca.Issue(dir, "master-srv", "cubemaster", pki.RoleMaster, "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	msrv, err := mf.MutualServer("test")
	if err != nil {
		t.Fatal(err)
	}
	return &cluster{
		server: srv, masterServer: msrv,
		proxy:  client("proxy", "cubeproxy", pki.RoleProxy),
		master: client("master", "cubemaster", pki.RoleMaster),
		node:   client("n2", "n2", pki.RoleNode),
		admin:  client("admin", "admin", pki.RoleAdmin),
	}
}

// upstream is a TCP server that answers "hello <what it read>" once the
// caller half-closes, then closes: it shows bytes and half-closes both
// cross the tunnel.
func upstream(t *testing.T) (ip string, port int) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				b, _ := io.ReadAll(c)
				fmt.Fprintf(c, "hello %s", b)
			}()
		}
	}()
	a := ln.Addr().(*net.TCPAddr)
	return a.IP.String(), a.Port
}

func serveNode(t *testing.T, c *cluster, eps map[string]Endpoint) string {
	t.Helper()
	return serveWith(t, c.server, eps)
}

func serveWith(t *testing.T, server *tls.Config, eps map[string]Endpoint) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	lookup := func(_ context.Context, id string) (Endpoint, error) {
		if id == "paused1" {
			return Endpoint{}, fmt.Errorf("sandbox %s is paused: %w", id, errdefs.ErrFailedPrecondition)
		}
		ep, ok := eps[id]
		if !ok {
			return Endpoint{}, fmt.Errorf("sandbox %s: %w", id, errdefs.ErrNotFound)
		}
		return ep, nil
	}
	go func() { _ = Serve(ctx, NewServer(lookup, nil), Listener(ln, server)); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return ln.Addr().String()
}

func roundTrip(ctx context.Context, d *Dialer, addr, node, id string, port int) (string, error) {
	conn, err := d.Dial(ctx, addr, node, id, port)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	if _, err := io.WriteString(conn, "world"); err != nil {
		return "", err
	}
	if err := conn.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
		return "", err
	}
	b, err := io.ReadAll(conn)
	return string(b), err
}

func TestTunnel(t *testing.T) {
	c := newCluster(t)
	ip, port := upstream(t)
	addr := serveNode(t, c, map[string]Endpoint{"sb1": {HostIP: ip}})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	// Control: the route's and the master's certificates reach the
	// sandbox, and the half-close crosses both ways.
	for name, tc := range map[string]*tls.Config{"proxy": c.proxy, "master": c.master} {
		got, err := roundTrip(ctx, &Dialer{TLS: tc}, addr, "n1", "sb1", port)
		if err != nil || got != "hello world" {
			t.Fatalf("%s certificate: got %q, %v; want hello world", name, got, err)
		}
		t.Logf("%s certificate: tunnel to sb1:%d answered %q", name, port, got)
	}
	// Refused: a node's or an operator's certificate, signed by the same
	// CA, on the same probe.
	for name, tc := range map[string]*tls.Config{"node": c.node, "admin": c.admin} {
		_, err := roundTrip(ctx, &Dialer{TLS: tc}, addr, "n1", "sb1", port)
		if !errdefs.IsPermissionDenied(err) {
			t.Fatalf("%s certificate: err %v, want PermissionDenied", name, err)
		}
		t.Logf("%s certificate refused by the node listener: %v", name, err)
	}
	// The caller checks the listener is the node it meant.
	if _, err := roundTrip(ctx, &Dialer{TLS: c.proxy}, addr, "n2", "sb1", port); !errdefs.IsUnavailable(err) || !strings.Contains(err.Error(), "n1") {
		t.Fatalf("listener of n1 taken for n2: err %v, want the handshake to fail", err)
	} else {
		t.Logf("n1's listener dialled as n2: %v", err)
	}
	for _, tc := range []struct {
		id   string
		port int
		is   func(error) bool
	}{
		{"nosuch", port, errdefs.IsNotFound},
		{"paused1", port, errdefs.IsFailedPrecondition},
		{"sb1", 1, errdefs.IsUnavailable}, // nothing listens on port 1
	} {
		if _, err := roundTrip(ctx, &Dialer{TLS: c.proxy}, addr, "n1", tc.id, tc.port); !tc.is(err) {
			t.Fatalf("%s:%d: err %v", tc.id, tc.port, err)
		} else {
			t.Logf("%s:%d: %v", tc.id, tc.port, err)
		}
	}
}

// TestNoClientCertificate: a TLS client without a certificate does not
// get past the handshake (MutualServer requires one).
func TestNoClientCertificate(t *testing.T) {
	c := newCluster(t)
	ip, port := upstream(t)
	addr := serveNode(t, c, map[string]Endpoint{"sb1": {HostIP: ip}})
	bare := c.proxy.Clone()
	bare.Certificates, bare.GetClientCertificate = nil, nil
	_, err := roundTrip(context.Background(), &Dialer{TLS: bare}, addr, "n1", "sb1", port)
	if err == nil {
		t.Fatal("a caller without a certificate reached the sandbox")
	}
	t.Logf("no client certificate: %v", err)
}

// TestClientChecksNodeRole: a listener holding a certificate of the
// cluster CA but not a node's (the master's, named like no node) is not
// taken for node n1; the control, n1's own listener, is.
func TestClientChecksNodeRole(t *testing.T) {
	c := newCluster(t)
	ip, port := upstream(t)
	eps := map[string]Endpoint{"sb1": {HostIP: ip}}
	impostor := serveWith(t, c.masterServer, eps)
	_, err := roundTrip(context.Background(), &Dialer{TLS: c.proxy}, impostor, "n1", "sb1", port)
	if err == nil || !strings.Contains(err.Error(), "role") {
		t.Fatalf("a master certificate taken for node n1: %v", err)
	}
	t.Logf("master-certificate listener dialled as node n1: %v", err)
	got, err := roundTrip(context.Background(), &Dialer{TLS: c.proxy}, serveNode(t, c, eps), "n1", "sb1", port)
	if err != nil || got != "hello world" {
		t.Fatalf("control: %q %v", got, err)
	}
}

// TestDialerFollowsRotation: the node's and the proxy's files are
// reissued from a new CA under a running listener and dialler; the
// dialler presents and trusts what the files hold now and gets through.
// The control, a copy of the dialler's config detached from its files,
// still holds the old CA and fails against the same listener.
func TestDialerFollowsRotation(t *testing.T) {
	dir := t.TempDir()
	ca1, err := pki.NewCA("CA 1")
	if err != nil {
		t.Fatal(err)
	}
	srvFiles, err := ca1.Issue(dir, "n1", "n1", pki.RoleNode, "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	cliFiles, err := ca1.Issue(dir, "proxy", "proxy-1", pki.RoleProxy)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := srvFiles.MutualServer("test")
	if err != nil {
		t.Fatal(err)
	}
	cli, err := cliFiles.Client("test")
	if err != nil {
		t.Fatal(err)
	}
	ip, port := upstream(t)
	addr := serveWith(t, srv, map[string]Endpoint{"sb1": {HostIP: ip}})
	d := &Dialer{TLS: cli}
	detached := cli.Clone()
	detached.RootCAs = cli.RootCAs.Clone() // the same trust, no longer its files'
	ctx := context.Background()
	for name, d := range map[string]*Dialer{"dialler": d, "detached copy": {TLS: detached}} {
		if got, err := roundTrip(ctx, d, addr, "n1", "sb1", port); err != nil || got != "hello world" {
			t.Fatalf("before the rotation, %s: %q %v", name, got, err)
		}
	}
	ca2, err := pki.NewCA("CA 2")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ca2.Issue(dir, "n1", "n1", pki.RoleNode, "127.0.0.1"); err != nil {
		t.Fatal(err)
	}
	if _, err := ca2.Issue(dir, "proxy", "proxy-1", pki.RoleProxy); err != nil {
		t.Fatal(err)
	}
	if got, err := roundTrip(ctx, d, addr, "n1", "sb1", port); err != nil || got != "hello world" {
		t.Fatalf("after the rotation, the dialler: %q %v", got, err)
	}
	_, err = roundTrip(ctx, &Dialer{TLS: detached}, addr, "n1", "sb1", port)
	if err == nil {
		t.Fatal("control: a config frozen at the old CA got through the rotated listener")
	}
	t.Logf("after the rotation: the dialler gets through; a config frozen at the old CA: %v", err)
}
