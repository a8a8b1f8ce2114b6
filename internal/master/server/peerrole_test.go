package server_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/cli"
	cubeletconfig "github.com/cubesandbox/cube/internal/cubelet/config"
	"github.com/cubesandbox/cube/internal/cubelet/masterlink"
	"github.com/cubesandbox/cube/internal/cubeproxy"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/pki"
	"github.com/cubesandbox/cube/internal/serve"
)

// impostor is a gRPC server behind mutual TLS with the cluster CA that
// presents files' certificate and serves every service of master and
// cubelet unimplemented; calls counts the calls that got through the
// handshake.
type impostor struct {
	addr  string
	calls atomic.Int32
}

func startImpostor(t *testing.T, files serve.TLSFiles) *impostor {
	t.Helper()
	tc, err := files.MutualServer("tls")
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	im := &impostor{addr: l.Addr().String()}
	gs := grpc.NewServer(grpc.Creds(credentials.NewTLS(tc)),
		grpc.UnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			im.calls.Add(1)
			return h(ctx, req)
		}),
		grpc.StreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
			im.calls.Add(1)
			return h(srv, ss)
		}))
	masterpb.RegisterNodeServiceServer(gs, masterpb.UnimplementedNodeServiceServer{})
	masterpb.RegisterAdminServiceServer(gs, masterpb.UnimplementedAdminServiceServer{})
	masterpb.RegisterRouteServiceServer(gs, masterpb.UnimplementedRouteServiceServer{})
	cubeletpb.RegisterCubeletServiceServer(gs, cubeletpb.UnimplementedCubeletServiceServer{})
	go func() { _ = gs.Serve(l) }()
	t.Cleanup(gs.Stop)
	return im
}

// TestClientsCheckPeerRole: every component link over mutual TLS checks
// the role (and, where the master dials a node, the name) of the server's
// certificate, not only that the cluster CA signed it. For each link the
// real client (cubelet's master link, cubeproxy's DialMaster, cubecli
// towards master and cubelet, the master towards a registered node) dials
// an impostor holding a valid cluster certificate of the wrong role or
// node: the handshake is refused and no call reaches it. The control: the
// same impostor with a certificate of the right role and name is called.
func TestClientsCheckPeerRole(t *testing.T) {
	ca, err := pki.NewCA("test cluster")
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
	files := map[string]serve.TLSFiles{
		"master": issue("master", "cubemaster", pki.RoleMaster),
		"node-1": issue("node-1", "node-1", pki.RoleNode),
		"node-2": issue("node-2", "node-2", pki.RoleNode),
		"proxy":  issue("proxy", "proxy-1", pki.RoleProxy),
		"admin":  issue("admin", "admin", pki.RoleAdmin),
	}
	client := func(name string) *serve.TLSFiles { f := files[name]; return &f }
	log := slog.New(slog.NewTextHandler(testWriter{t}, nil))

	// reached dials an impostor presenting the certificate server with
	// the link's client, and says whether a call got through.
	type link struct {
		name   string
		right  string   // the certificate the server must present
		wrong  []string // valid cluster certificates it must not accept
		client string   // the certificate the client presents
		dial   func(t *testing.T, im *impostor, client serve.TLSFiles) error
	}
	links := []link{
		{"cubelet -> master (masterlink)", "master", []string{"node-2", "proxy", "admin"}, "node-1",
			func(t *testing.T, im *impostor, c serve.TLSFiles) error {
				tc, err := c.Client("tls")
				if err != nil {
					t.Fatal(err)
				}
				l, err := masterlink.New(cubeletconfig.MasterConfig{Addr: im.addr, HeartbeatInterval: cubeletconfig.Duration{Duration: 50 * time.Millisecond}}, tc,
					func(context.Context) *masterpb.NodeReport {
						return &masterpb.NodeReport{NodeId: "node-1", Address: "127.0.0.1:1"}
					}, log)
				if err != nil {
					t.Fatal(err)
				}
				l.Run()
				time.Sleep(time.Second) // 20 heartbeat intervals
				l.Stop()
				return nil
			}},
		{"cubeproxy -> master (DialMaster)", "master", []string{"node-1", "proxy", "admin"}, "proxy",
			func(t *testing.T, im *impostor, c serve.TLSFiles) error {
				tc, err := c.Client("--master-tls-*")
				if err != nil {
					t.Fatal(err)
				}
				conn, err := cubeproxy.DialMaster(im.addr, "token", tc)
				if err != nil {
					t.Fatal(err)
				}
				defer conn.Close()
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				_, err = masterpb.NewRouteServiceClient(conn).ResolveRoute(ctx, &masterpb.ResolveRouteRequest{SandboxId: "abc"})
				return err
			}},
		{"cubecli -> master (cluster commands)", "master", []string{"node-1", "proxy", "admin"}, "admin",
			func(t *testing.T, im *impostor, c serve.TLSFiles) error {
				return runCLI("apikey", "ls", "--master", im.addr, "--tls-cert", c.Cert, "--tls-key", c.Key, "--tls-ca", c.CA, "--timeout", "5s")
			}},
		{"cubecli -> cubelet", "node-1", []string{"master", "proxy", "admin"}, "admin",
			func(t *testing.T, im *impostor, c serve.TLSFiles) error {
				return runCLI("sandbox", "ls", "--addr", im.addr, "--tls-cert", c.Cert, "--tls-key", c.Key, "--tls-ca", c.CA, "--timeout", "5s")
			}},
	}
	for _, l := range links {
		for _, w := range l.wrong {
			im := startImpostor(t, files[w])
			err := l.dial(t, im, *client(l.client))
			if n := im.calls.Load(); n != 0 {
				t.Errorf("%s: the client called a server presenting %s's certificate (%d calls; %v)", l.name, w, n, err)
				continue
			}
			t.Logf("%s, server with %s's certificate: refused, no call (%v)", l.name, w, err)
		}
		im := startImpostor(t, files[l.right])
		err := l.dial(t, im, *client(l.client))
		if im.calls.Load() == 0 {
			t.Errorf("control: %s: no call reached a server with %s's certificate: %v", l.name, l.right, err)
			continue
		}
		t.Logf("control: %s, server with %s's certificate: called (%v)", l.name, l.right, err)
	}

	// The master dials a node at the address the node registered: only
	// that node's certificate answers there. Each probe registers its own
	// node (a live node's ID is not taken over) whose address is an
	// impostor's.
	nodePort := freePort(t)
	m := mastertest.StartMaster(t, fmt.Sprintf("[api]\nnode = \"127.0.0.1:%s\"\n[tls]\ncert = %q\nkey = %q\nca = %q\n",
		nodePort, files["master"].Cert, files["master"].Key, files["master"].CA))
	t.Cleanup(m.Stop)
	for _, c := range []struct {
		node, server string
		control      bool
	}{
		{"node-a", "node-2", false}, // right role, another node
		{"node-b", "master", false},
		{"node-c", "proxy", false},
		{"node-d", "node-d", true},
	} {
		if _, ok := files[c.node]; !ok {
			files[c.node] = issue(c.node, c.node, pki.RoleNode)
		}
		im := startImpostor(t, files[c.server])
		tc, err := files[c.node].Client("tls")
		if err != nil {
			t.Fatal(err)
		}
		conn, err := grpc.NewClient("127.0.0.1:"+nodePort, grpc.WithTransportCredentials(credentials.NewTLS(tc)))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err = masterpb.NewNodeServiceClient(conn).Register(ctx, &masterpb.RegisterRequest{Node: &masterpb.NodeReport{NodeId: c.node, Address: im.addr}})
		cancel()
		conn.Close()
		// Register itself may fail: it reconciles the node, which the
		// master cannot reach.
		deadline := time.Now().Add(3 * time.Second)
		for im.calls.Load() == 0 && time.Now().Before(deadline) {
			time.Sleep(50 * time.Millisecond)
		}
		n := im.calls.Load()
		switch {
		case c.control && n == 0:
			t.Errorf("control: the master never called node %s presenting its own certificate (register: %v)", c.node, err)
		case c.control:
			t.Logf("control: the master called node %s presenting its own certificate (%d calls; register: %v)", c.node, n, err)
		case n != 0:
			t.Errorf("the master called node %s at a server presenting %s's certificate (%d calls)", c.node, c.server, n)
		default:
			t.Logf("the master dialling node %s refused a server presenting %s's certificate: no call (register: %v)", c.node, c.server, err)
		}
	}
}

// runCLI runs cubecli with args; the error is the command's.
func runCLI(args ...string) error {
	var out bytes.Buffer
	root := cli.NewRoot(&out)
	root.SetArgs(args)
	root.SetOut(&out)
	root.SetErr(&out)
	err := root.ExecuteContext(context.Background())
	if err != nil {
		return fmt.Errorf("%w: %s", err, strings.TrimSpace(out.String()))
	}
	return nil
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
