package server_test

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/cubeproxy"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/server"
	"github.com/cubesandbox/cube/internal/pki"
	"github.com/cubesandbox/cube/internal/serve"
)

func config(t *testing.T, set func(*master.Config)) *master.Config {
	t.Helper()
	dir := t.TempDir()
	cfg, err := master.ParseConfig([]byte(fmt.Sprintf(`
[api]
e2b = "127.0.0.1:0"
node = ""
socket = %q
[proxy]
listen = "127.0.0.1:0"
[catalog]
dsn = %q
`, filepath.Join(dir, "master.sock"), filepath.Join(dir, "catalog.db"))))
	if err != nil {
		t.Fatal(err)
	}
	if set != nil {
		set(cfg)
	}
	return cfg
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

// TestListenersBeyondLoopbackNeedTLS: cubemaster refuses to start when a
// listener is configured beyond loopback without TLS, naming the setting;
// with TLS configured the same addresses start (the controls), and on
// api.node only a caller with a certificate of the cluster CA is served.
func TestListenersBeyondLoopbackNeedTLS(t *testing.T) {
	ca, err := pki.NewCA("test cluster")
	if err != nil {
		t.Fatal(err)
	}
	certs := t.TempDir()
	masterFiles, err := ca.Issue(certs, "master", "cubemaster", pki.RoleMaster, "127.0.0.1", "localhost")
	if err != nil {
		t.Fatal(err)
	}
	nodeFiles, err := ca.Issue(certs, "node", "node-1", pki.RoleNode, "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		setting string
		set     func(*master.Config)
	}{
		{"api.node", func(c *master.Config) { c.API.Node = "0.0.0.0:0" }},
		{"api.e2b", func(c *master.Config) { c.API.E2B = "0.0.0.0:0" }},
		{"proxy.listen", func(c *master.Config) { c.Proxy.Listen = "0.0.0.0:0" }},
		{"proxy.metrics", func(c *master.Config) { c.Proxy.Metrics = "0.0.0.0:0" }},
	} {
		t.Run("refused/"+c.setting, func(t *testing.T) {
			cfg := config(t, c.set)
			s, err := server.Start(context.Background(), cfg, nil)
			if err == nil {
				_ = s.Stop()
				t.Fatalf("%s beyond loopback without TLS: started", c.setting)
			}
			if !errors.Is(err, serve.ErrNotLocal) || !strings.Contains(err.Error(), c.setting+" = ") {
				t.Fatalf("%v, want ErrNotLocal naming %s", err, c.setting)
			}
			t.Logf("refused: %v", err)
			// Nothing is left open: the same config on loopback starts.
			cfg.API.E2B, cfg.API.Node, cfg.Proxy.Listen, cfg.Proxy.Metrics = "127.0.0.1:0", "", "127.0.0.1:0", "127.0.0.1:0"
			s, err = server.Start(context.Background(), cfg, nil)
			if err != nil {
				t.Fatalf("the same master on loopback: %v", err)
			}
			if err := s.Stop(); err != nil {
				t.Fatal(err)
			}
		})
	}

	t.Run("control/api.e2b with TLS", func(t *testing.T) {
		cfg := config(t, func(c *master.Config) {
			c.API.E2B, c.API.E2BTLSCert, c.API.E2BTLSKey = "0.0.0.0:0", masterFiles.Cert, masterFiles.Key
		})
		s, err := server.Start(context.Background(), cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Stop() })
		tc, err := nodeFiles.Client("tls")
		if err != nil {
			t.Fatal(err)
		}
		tc.Certificates = nil // SDKs hold no client certificate
		_, port, _ := net.SplitHostPort(s.E2BAddr)
		hc := &http.Client{Transport: &http.Transport{TLSClientConfig: tc}, Timeout: 5 * time.Second}
		resp, err := hc.Get("https://127.0.0.1:" + port + "/health")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("GET /health over TLS: %d", resp.StatusCode)
		}
	})

	t.Run("control/proxy.listen with TLS", func(t *testing.T) {
		s, err := server.Start(context.Background(), config(t, func(c *master.Config) {
			c.Proxy.Listen, c.Proxy.TLSSelfSigned = "0.0.0.0:0", true
		}), nil)
		if err != nil {
			t.Fatal(err)
		}
		_ = s.Stop()
	})

	t.Run("control/api.node with [tls]", func(t *testing.T) {
		port := freePort(t)
		s, err := server.Start(context.Background(), config(t, func(c *master.Config) {
			c.API.Node, c.TLS = "0.0.0.0:"+port, masterFiles
		}), nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Stop() })
		good, err := nodeFiles.Client("tls")
		if err != nil {
			t.Fatal(err)
		}
		noCert := good.Clone()
		noCert.Certificates = nil
		call := func(tc *tls.Config) error {
			conn, err := grpc.NewClient("127.0.0.1:"+port, grpc.WithTransportCredentials(credentials.NewTLS(tc)))
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			// node-1's report without an address: the handler refuses it
			// (InvalidArgument), which shows the call reached it.
			_, err = masterpb.NewNodeServiceClient(conn).Register(ctx, &masterpb.RegisterRequest{Node: &masterpb.NodeReport{NodeId: "node-1"}})
			return err
		}
		err = call(noCert)
		if status.Code(err) != codes.Unavailable {
			t.Fatalf("Register without a client certificate: %v, want Unavailable (handshake refused)", err)
		}
		t.Logf("without a client certificate: %v", err)
		err = call(good)
		if status.Code(err) != codes.InvalidArgument {
			t.Fatalf("control: Register with the node's certificate: %v, want InvalidArgument from the handler", err)
		}
		t.Logf("control: with the node's certificate the handler answers: %v", err)
	})
}

// TestNodeIdentityBoundToCertificate: over mutual TLS a node registers and
// heartbeats only as the node its certificate names. Probes: node-1's
// certificate registering and heartbeating as node-2, and the master's
// and an admin's certificate registering as node-2: PermissionDenied,
// and the catalog holds no node. Control: node-2's certificate registers
// node-2, which the catalog then lists. Over the same listener the admin
// API (api.admin_token set) refuses a node's certificate with the right
// token and serves an admin certificate (control), and RouteService, as
// cubeproxy dials it, refuses a node's certificate and serves a proxy's.
func TestNodeIdentityBoundToCertificate(t *testing.T) {
	ca, err := pki.NewCA("test cluster")
	if err != nil {
		t.Fatal(err)
	}
	certs := t.TempDir()
	issue := func(base, name string, role pki.Role) *tls.Config {
		f, err := ca.Issue(certs, base, name, role, "127.0.0.1")
		if err != nil {
			t.Fatal(err)
		}
		tc, err := f.Client("tls")
		if err != nil {
			t.Fatal(err)
		}
		return tc
	}
	masterFiles, err := ca.Issue(certs, "master", "cubemaster", pki.RoleMaster, "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	node1, node2 := issue("node1", "node-1", pki.RoleNode), issue("node2", "node-2", pki.RoleNode)
	masterCert, admin := issue("master-client", "cubemaster", pki.RoleMaster), issue("admin", "ops", pki.RoleAdmin)

	port := freePort(t)
	cfg := config(t, func(c *master.Config) {
		c.API.Node, c.TLS, c.API.AdminToken = "127.0.0.1:"+port, masterFiles, "admin-secret"
	})
	s, err := server.Start(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Stop() })
	dial := func(tc *tls.Config) *grpc.ClientConn {
		conn, err := grpc.NewClient("127.0.0.1:"+port, grpc.WithTransportCredentials(credentials.NewTLS(tc)))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return conn
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	report := &masterpb.NodeReport{NodeId: "node-2", Address: "127.0.0.1:1"}
	nodes := func() int {
		n, err := s.Service.Nodes(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return len(n)
	}
	for _, c := range []struct {
		name string
		tc   *tls.Config
	}{{"node-1's certificate", node1}, {"the master's certificate", masterCert}, {"an admin certificate", admin}} {
		ns := masterpb.NewNodeServiceClient(dial(c.tc))
		_, err := ns.Register(ctx, &masterpb.RegisterRequest{Node: report})
		if status.Code(err) != codes.PermissionDenied {
			t.Fatalf("Register node-2 with %s: %v, want PermissionDenied", c.name, err)
		}
		t.Logf("Register node-2 with %s: %v", c.name, err)
		_, err = ns.Heartbeat(ctx, &masterpb.HeartbeatRequest{Node: report})
		if status.Code(err) != codes.PermissionDenied {
			t.Fatalf("Heartbeat node-2 with %s: %v, want PermissionDenied", c.name, err)
		}
	}
	if n := nodes(); n != 0 {
		t.Fatalf("the refused registrations left %d nodes in the catalog", n)
	}
	if _, err := masterpb.NewNodeServiceClient(dial(node2)).Register(ctx, &masterpb.RegisterRequest{Node: report}); err != nil {
		t.Fatalf("control: node-2 registering with its own certificate: %v", err)
	}
	if n := nodes(); n != 1 {
		t.Fatalf("control: after node-2 registered the catalog holds %d nodes", n)
	}
	t.Log("control: node-2's certificate registers node-2")

	withToken := metadata.AppendToOutgoingContext(ctx, masterpb.AdminTokenHeader, "admin-secret")
	if _, err := masterpb.NewAdminServiceClient(dial(node1)).ListNodes(withToken, &masterpb.ListNodesRequest{}); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("admin API with a node's certificate and the token: %v, want PermissionDenied", err)
	}
	if _, err := masterpb.NewAdminServiceClient(dial(admin)).ListNodes(withToken, &masterpb.ListNodesRequest{}); err != nil {
		t.Fatalf("control: admin API with an admin certificate and the token: %v", err)
	}
	t.Log("admin API: a node's certificate is refused, an admin's served")

	// cubeproxy's link: RouteService with a proxy certificate (and the
	// token), the way cubeproxy --master host:port --master-tls-* dials.
	proxyFiles, err := ca.Issue(certs, "proxy", "proxy-1", pki.RoleProxy)
	if err != nil {
		t.Fatal(err)
	}
	ptc, err := proxyFiles.Client("tls")
	if err != nil {
		t.Fatal(err)
	}
	route := func(tc *tls.Config) error {
		conn, err := cubeproxy.DialMaster("127.0.0.1:"+port, "admin-secret", tc)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		_, err = masterpb.NewRouteServiceClient(conn).ResolveRoute(ctx, &masterpb.ResolveRouteRequest{SandboxId: "nosuchsandbox00000000"})
		return err
	}
	if err := route(node1); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("RouteService with a node's certificate: %v, want PermissionDenied", err)
	}
	if err := route(ptc); status.Code(err) == codes.PermissionDenied || status.Code(err) == codes.Unavailable || status.Code(err) == codes.Unauthenticated {
		t.Fatalf("control: RouteService with a proxy certificate: %v, want the handler's answer", err)
	} else {
		t.Logf("control: RouteService with a proxy certificate reaches the handler: %v", err)
	}
}

// TestSecondRegistrantRefused: while a node is live, a registration or a
// heartbeat under its ID from another machine (boot ID) or address is
// AlreadyExists and the catalog keeps the node as it was. Controls: the
// same cubelet registering again (a restart: same boot ID and address)
// is accepted, and so is the other machine once the node has been silent
// for nodes.unhealthy_after.
func TestSecondRegistrantRefused(t *testing.T) {
	cfg := config(t, func(c *master.Config) {
		c.Nodes.HeartbeatInterval.Duration, c.Nodes.UnhealthyAfter.Duration = 100*time.Millisecond, time.Second
	})
	s, err := server.Start(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Stop() })
	ctx := context.Background()
	live := &masterpb.NodeReport{NodeId: "node-x", Address: "127.0.0.1:1", BootId: "boot-a"}
	if err := s.Service.Register(ctx, live); err != nil {
		t.Fatal(err)
	}
	recorded := func() (int, string) {
		nodes, err := s.Service.Nodes(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range nodes {
			if n.Report.NodeId == "node-x" {
				return len(nodes), n.Report.Address + " " + n.Report.BootId
			}
		}
		return len(nodes), ""
	}
	for _, rogue := range []*masterpb.NodeReport{
		{NodeId: "node-x", Address: "127.0.0.1:2", BootId: "boot-b"},
		{NodeId: "node-x", Address: "127.0.0.1:2", BootId: "boot-a"},
		{NodeId: "node-x", Address: "127.0.0.1:1", BootId: "boot-b"},
	} {
		err := s.Service.Register(ctx, rogue)
		if !errdefs.IsAlreadyExists(err) {
			t.Fatalf("register %s/%s over the live node: %v, want AlreadyExists", rogue.Address, rogue.BootId, err)
		}
		t.Logf("register %s/%s: %v", rogue.Address, rogue.BootId, err)
		if _, err := s.Service.Heartbeat(ctx, rogue); !errdefs.IsAlreadyExists(err) {
			t.Fatalf("heartbeat %s/%s over the live node: %v, want AlreadyExists", rogue.Address, rogue.BootId, err)
		}
		if n, got := recorded(); n != 1 || got != "127.0.0.1:1 boot-a" {
			t.Fatalf("after the refused report the catalog holds %d nodes, node-x %q", n, got)
		}
	}
	if err := s.Service.Register(ctx, live); err != nil {
		t.Fatalf("control: the same cubelet registering again: %v", err)
	}
	time.Sleep(1200 * time.Millisecond) // node-x silent past unhealthy_after
	moved := &masterpb.NodeReport{NodeId: "node-x", Address: "127.0.0.1:2", BootId: "boot-b"}
	if err := s.Service.Register(ctx, moved); err != nil {
		t.Fatalf("control: registering once the node went silent: %v", err)
	}
	if _, got := recorded(); got != "127.0.0.1:2 boot-b" {
		t.Fatalf("control: node-x recorded as %q after it moved", got)
	}
	t.Log("controls: a restart registers at once; another machine once the node went silent")
}
