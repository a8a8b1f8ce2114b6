package server_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/cubeletapi"
	"github.com/cubesandbox/cube/internal/cubeletclient"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/pki"
	"github.com/cubesandbox/cube/internal/serve"
)

// TestNodeOverMutualTLS is the multi-node setup of docs/control-plane.md
// on one machine: cubemaster's api.node and cubelet's api.tcp bound to
// every interface, both with [tls]. cubelet refuses api.tcp beyond
// loopback without TLS; with it, the node registers and heartbeats over
// mutual TLS and the master imports a template on it over mutual TLS. A
// caller without the cluster's certificate, and one with another node's,
// is refused by the node's api.tcp; the master's certificate is served
// (the control).
func TestNodeOverMutualTLS(t *testing.T) {
	ca, err := pki.NewCA("test cluster")
	if err != nil {
		t.Fatal(err)
	}
	certs := t.TempDir()
	masterFiles, err := ca.Issue(certs, "master", "cubemaster", pki.RoleMaster, "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	nodePort, apiPort := freePort(t), freePort(t)
	m := mastertest.StartMaster(t, fmt.Sprintf("[api]\nnode = \"0.0.0.0:%s\"\n[tls]\ncert = %q\nkey = %q\nca = %q\n",
		nodePort, masterFiles.Cert, masterFiles.Key, masterFiles.CA))

	env := cubelettest.New(t, "")
	nodeFiles, err := ca.Issue(certs, "node", env.Config.Node.ID, pki.RoleNode, "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	cfg := env.Config
	cfg.API.TCP = "0.0.0.0:" + apiPort
	cfg.Master.Addr = "127.0.0.1:" + nodePort
	cfg.Master.Advertise = "127.0.0.1:" + apiPort
	cfg.Master.HeartbeatInterval.Duration = 200 * time.Millisecond
	cfg.TLS = nodeFiles
	log := mastertest.Log(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	svc, err := cubelet.New(ctx, cfg, log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = svc.Close() })

	// Without [tls], api.tcp beyond loopback is refused at start.
	cfg.TLS = serve.TLSFiles{}
	err = cubeletapi.Serve(ctx, svc, log)
	cfg.TLS = nodeFiles
	if !errors.Is(err, serve.ErrNotLocal) || !strings.Contains(err.Error(), "api.tcp = ") {
		t.Fatalf("cubelet api.tcp beyond loopback without TLS: %v, want ErrNotLocal naming api.tcp", err)
	}
	t.Logf("cubelet without [tls]: %v", err)

	sctx, stop := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- cubeletapi.Serve(sctx, svc, log) }()
	t.Cleanup(func() {
		stop()
		if err := <-served; err != nil {
			t.Errorf("cubelet API: %v", err)
		}
	})

	mastertest.WaitFor(t, 30*time.Second, "the node to register over mutual TLS and turn healthy", func() bool {
		n := m.Node(t, cfg.Node.ID)
		return n != nil && n.Healthy
	})
	t.Log("the node registered and heartbeats over mutual TLS")
	ictx, icancel := context.WithTimeout(context.Background(), time.Minute)
	defer icancel()
	if _, err := m.Admin.ImportTemplate(ictx, &masterpb.ImportTemplateRequest{TemplateId: "tls-probe", Source: env.Image, NodeId: cfg.Node.ID}); err != nil {
		t.Fatalf("the master importing a template on the node over mutual TLS: %v", err)
	}
	t.Log("the master called the node over mutual TLS (ImportTemplate)")

	health := func(conn cubeletpb.CubeletServiceClient) error {
		hctx, hcancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer hcancel()
		_, err := conn.Health(hctx, &cubeletpb.HealthRequest{})
		return err
	}
	plain, err := cubeletclient.Dial("127.0.0.1:" + apiPort)
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	if err := health(cubeletclient.New(plain)); err == nil {
		t.Fatal("a plaintext caller reached cubelet's api.tcp")
	} else {
		t.Logf("plaintext caller: %v", err)
	}
	noCert, err := nodeFiles.Client("tls")
	if err != nil {
		t.Fatal(err)
	}
	noCert.Certificates = nil
	anon, err := cubeletclient.DialTLS("127.0.0.1:"+apiPort, noCert)
	if err != nil {
		t.Fatal(err)
	}
	defer anon.Close()
	if err := health(cubeletclient.New(anon)); err == nil {
		t.Fatal("a TLS caller without a certificate reached cubelet's api.tcp")
	} else {
		t.Logf("TLS caller without a certificate: %v", err)
	}
	otherFiles, err := ca.Issue(certs, "other-node", "other-node", pki.RoleNode, "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	oc, err := otherFiles.Client("tls")
	if err != nil {
		t.Fatal(err)
	}
	otherNode, err := cubeletclient.DialTLS("127.0.0.1:"+apiPort, oc)
	if err != nil {
		t.Fatal(err)
	}
	defer otherNode.Close()
	if err := health(cubeletclient.New(otherNode)); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("another node's certificate calling cubelet's api.tcp: %v, want PermissionDenied", err)
	} else {
		t.Logf("another node's certificate: %v", err)
	}
	mc, err := masterFiles.Client("tls")
	if err != nil {
		t.Fatal(err)
	}
	good, err := cubeletclient.DialTLS("127.0.0.1:"+apiPort, mc)
	if err != nil {
		t.Fatal(err)
	}
	defer good.Close()
	if err := health(cubeletclient.New(good)); err != nil {
		t.Fatalf("control: the master's certificate: %v", err)
	}
	t.Log("control: a caller with the master's certificate is served")
}
