package server_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/cubeletapi"
	"github.com/cubesandbox/cube/internal/cubeletclient"
	"github.com/cubesandbox/cube/internal/cubeproxy"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/pki"
	"github.com/cubesandbox/cube/internal/serve"
)

// TestDaemonsAcrossCARotation: cubemaster (api.node with [tls] and an
// admin token) and a cubelet (api.tcp with [tls], its master link over
// mutual TLS), both started once from the files of one CA directory, go
// through a reissue of their certificates and a CA rotation
// (pki.BeginRotation, PromoteRotation, reissue, FinishRotation) without a
// restart. After each step: the node is healthy and its heartbeats keep
// arriving, the master imports a template on the node, and an operator's
// clients made before any change (an admin certificate: cubelet's api.tcp
// and the master's AdminService on api.node) open new connections and are
// served. A copy of the admin certificate of the old CA is admitted by
// both listeners before the drop (the control) and refused after it.
// Last, the master is restarted: the cubelet, still on the client config
// it made at its start, registers again over a new handshake with its
// reissued certificate and the new bundle.
func TestDaemonsAcrossCARotation(t *testing.T) {
	dir := t.TempDir()
	ca, err := pki.LoadOrCreateCA(dir, "test cluster")
	if err != nil {
		t.Fatal(err)
	}
	env := cubelettest.New(t, "")
	nodeID := env.Config.Node.ID
	issue := func(ca *pki.CA) (master, node, admin serve.TLSFiles) {
		t.Helper()
		var err error
		if master, err = ca.Issue(dir, "master", "cubemaster", pki.RoleMaster, "127.0.0.1"); err != nil {
			t.Fatal(err)
		}
		if node, err = ca.Issue(dir, "node", nodeID, pki.RoleNode, "127.0.0.1"); err != nil {
			t.Fatal(err)
		}
		if admin, err = ca.Issue(dir, "admin", "admin", pki.RoleAdmin); err != nil {
			t.Fatal(err)
		}
		return master, node, admin
	}
	masterFiles, nodeFiles, adminFiles := issue(ca)
	oldDir := t.TempDir()
	oldAdmin := serve.TLSFiles{Cert: filepath.Join(oldDir, "admin.crt"), Key: filepath.Join(oldDir, "admin.key")}
	for _, f := range [][2]string{{adminFiles.Cert, oldAdmin.Cert}, {adminFiles.Key, oldAdmin.Key}} {
		b, err := os.ReadFile(f[0])
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(f[1], b, 0o600); err != nil {
			t.Fatal(err)
		}
	}

	const token = "rotation-test-token"
	nodePort, apiPort := freePort(t), freePort(t)
	m := mastertest.StartMaster(t, fmt.Sprintf("[api]\nnode = \"127.0.0.1:%s\"\nadmin_token = %q\n[tls]\ncert = %q\nkey = %q\nca = %q\n",
		nodePort, token, masterFiles.Cert, masterFiles.Key, masterFiles.CA))
	cfg := env.Config
	cfg.API.TCP = "127.0.0.1:" + apiPort
	cfg.Master.Addr = "127.0.0.1:" + nodePort
	cfg.Master.Advertise = "127.0.0.1:" + apiPort
	cfg.Master.HeartbeatInterval.Duration = 200 * time.Millisecond
	cfg.TLS = nodeFiles
	log := mastertest.Log(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	svc, err := cubelet.New(ctx, cfg, log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = svc.Close() })
	sctx, stop := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- cubeletapi.Serve(sctx, svc, log) }()
	t.Cleanup(func() {
		stop()
		if err := <-served; err != nil {
			t.Errorf("cubelet API: %v", err)
		}
	})
	mastertest.WaitFor(t, 30*time.Second, "the node to register over mutual TLS", func() bool {
		n := m.Node(t, nodeID)
		return n != nil && n.Healthy
	})

	// The operator's client config, made once before any change.
	adminTC, err := adminFiles.Client("tls")
	if err != nil {
		t.Fatal(err)
	}
	cctx := func() (context.Context, context.CancelFunc) {
		return context.WithTimeout(context.Background(), 10*time.Second)
	}
	callNode := func(tc *tls.Config) error {
		conn, err := cubeletclient.DialTLS("127.0.0.1:"+apiPort, tc)
		if err != nil {
			return err
		}
		defer conn.Close()
		c, cancel := cctx()
		defer cancel()
		_, err = cubeletclient.New(conn).Health(c, &cubeletpb.HealthRequest{})
		return err
	}
	callMaster := func(tc *tls.Config) error {
		conn, err := cubeproxy.DialMaster("127.0.0.1:"+nodePort, token, tc)
		if err != nil {
			return err
		}
		defer conn.Close()
		c, cancel := cctx()
		defer cancel()
		_, err = masterpb.NewAdminServiceClient(conn).ListNodes(c, &masterpb.ListNodesRequest{})
		return err
	}
	imports := 0
	step := func(name string) {
		t.Helper()
		before := m.Node(t, nodeID).LastHeartbeat.AsTime()
		mastertest.WaitFor(t, 10*time.Second, name+": a heartbeat after the change", func() bool {
			n := m.Node(t, nodeID)
			return n.Healthy && n.LastHeartbeat.AsTime().After(before)
		})
		imports++
		ic, icancel := context.WithTimeout(context.Background(), time.Minute)
		defer icancel()
		if _, err := m.Admin.ImportTemplate(ic, &masterpb.ImportTemplateRequest{TemplateId: fmt.Sprintf("rot-%d", imports), Source: env.Image, NodeId: nodeID}); err != nil {
			t.Fatalf("%s: the master calling the node: %v", name, err)
		}
		if err := callNode(adminTC); err != nil {
			t.Fatalf("%s: the admin client made before the change, at cubelet's api.tcp: %v", name, err)
		}
		if err := callMaster(adminTC); err != nil {
			t.Fatalf("%s: the admin client made before the change, at the master's api.node: %v", name, err)
		}
		t.Logf("%s: node healthy and heartbeating, master -> node served, admin -> node and admin -> master served on new connections", name)
	}
	// oldAdminTC presents the old CA's admin certificate whatever the
	// server names as acceptable, trusting the bundle of the moment.
	oldAdminTC := func() *tls.Config {
		cert, err := tls.LoadX509KeyPair(oldAdmin.Cert, oldAdmin.Key)
		if err != nil {
			t.Fatal(err)
		}
		trust, err := serve.TLSFiles{Cert: adminFiles.Cert, Key: adminFiles.Key, CA: adminFiles.CA}.Client("tls")
		if err != nil {
			t.Fatal(err)
		}
		return &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: trust.RootCAs,
			GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &cert, nil }}
	}
	// rawProbe opens a TLS connection with tc and reads: a listener that
	// admitted the certificate speaks first (gRPC's HTTP/2 settings), one
	// that refused it sends its alert (crypto/tls reports it at the read).
	rawProbe := func(port string, tc *tls.Config) error {
		tc = tc.Clone()
		tc.ServerName, tc.NextProtos = "127.0.0.1", []string{"h2"}
		conn, err := tls.Dial("tcp", "127.0.0.1:"+port, tc)
		if err != nil {
			return err
		}
		defer conn.Close()
		_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err = conn.Read(make([]byte, 64))
		return err
	}
	listeners := []struct{ name, port string }{{"cubelet api.tcp", apiPort}, {"master api.node", nodePort}}

	step("start")
	_, _, adminFiles = issue(ca)
	step("reissue")
	if _, err := pki.BeginRotation(dir, "test cluster"); err != nil {
		t.Fatal(err)
	}
	step("ca-begin")
	newCA, err := pki.PromoteRotation(dir)
	if err != nil {
		t.Fatal(err)
	}
	masterFiles, nodeFiles, adminFiles = issue(newCA)
	step("ca-promote and reissue")
	for _, l := range listeners {
		if err := rawProbe(l.port, oldAdminTC()); err != nil {
			t.Fatalf("control: the old CA's admin certificate at %s before the drop: %v", l.name, err)
		}
	}
	t.Log("control: the old CA's admin certificate is admitted by cubelet and the master before the drop")
	if err := pki.FinishRotation(dir, masterFiles.Cert, nodeFiles.Cert, adminFiles.Cert); err != nil {
		t.Fatal(err)
	}
	step("ca-finish")
	for _, l := range listeners {
		err := rawProbe(l.port, oldAdminTC())
		if err == nil || !strings.Contains(err.Error(), "unknown certificate authority") {
			t.Fatalf("the old CA's admin certificate at %s after the drop: %v, want refused", l.name, err)
		}
		t.Logf("after the drop, the old CA's admin certificate at %s: %v", l.name, err)
	}

	// The cubelet's link, dialled again with the config it made at start.
	m.Stop()
	m.Start()
	mastertest.WaitFor(t, 30*time.Second, "the node to register with the restarted master", func() bool {
		n := m.Node(t, nodeID)
		return n != nil && n.Healthy
	})
	step("master restarted")
}
