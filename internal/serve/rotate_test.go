package serve_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/cubesandbox/cube/internal/pki"
	"github.com/cubesandbox/cube/internal/serve"
)

// TestRotationWithoutRestart: a mutual-TLS gRPC listener and its clients
// keep serving, with no restart and no failed call, while the files under
// them go through a reissue of the leaf certificates and a CA rotation
// (pki.BeginRotation, PromoteRotation, reissue, FinishRotation). A
// background caller on a long-lived connection and on fresh connections
// (a handshake each) counts failures. After the old CA is dropped, a
// client presenting a certificate of the old CA is refused; the control:
// the same client was admitted just before the drop. A certificate file
// that does not load is ignored (the previous one keeps serving).
func TestRotationWithoutRestart(t *testing.T) {
	dir := t.TempDir()
	ca, err := pki.LoadOrCreateCA(dir, "test CA")
	if err != nil {
		t.Fatal(err)
	}
	issue := func(ca *pki.CA) (srv, cli serve.TLSFiles) {
		t.Helper()
		if srv, err = ca.Issue(dir, "server", "server", pki.RoleNode, "127.0.0.1"); err != nil {
			t.Fatal(err)
		}
		if cli, err = ca.Issue(dir, "client", "client", pki.RoleMaster); err != nil {
			t.Fatal(err)
		}
		return srv, cli
	}
	srvFiles, cliFiles := issue(ca)
	if srvFiles.CA != filepath.Join(dir, pki.CACertFile) {
		t.Fatalf("issued bundle %s, want the CA directory's %s", srvFiles.CA, pki.CACertFile)
	}
	// The client of the old CA: copies of its certificate and key, trusting
	// the live bundle (so what stops it is the server's trust, not its own).
	oldDir := t.TempDir()
	oldCli := serve.TLSFiles{Cert: filepath.Join(oldDir, "client.crt"), Key: filepath.Join(oldDir, "client.key"), CA: srvFiles.CA}
	for _, f := range [][2]string{{cliFiles.Cert, oldCli.Cert}, {cliFiles.Key, oldCli.Key}} {
		b, err := os.ReadFile(f[0])
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(f[1], b, 0o600); err != nil {
			t.Fatal(err)
		}
	}

	mtls, err := srvFiles.MutualServer("tls")
	if err != nil {
		t.Fatal(err)
	}
	g := &serve.Group{Grace: time.Second}
	l, err := g.TCP("api.grpc", "[tls]", "127.0.0.1:0", mtls)
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	healthpb.RegisterHealthServer(gs, health.NewServer())
	g.GRPC("test API", gs, l)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- g.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	addr := l.Addr().String()

	dial := func(f serve.TLSFiles) *grpc.ClientConn {
		t.Helper()
		tc, err := f.Client("tls")
		if err != nil {
			t.Fatal(err)
		}
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(serve.ClientCredentials(tc)))
		if err != nil {
			t.Fatal(err)
		}
		return conn
	}
	check := func(conn *grpc.ClientConn) error {
		cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
		defer ccancel()
		_, err := healthpb.NewHealthClient(conn).Check(cctx, &healthpb.HealthCheckRequest{})
		return err
	}
	probe := func(f serve.TLSFiles) error {
		conn := dial(f)
		defer conn.Close()
		return check(conn)
	}
	// probeOld presents the old CA's certificate whatever CAs the server
	// names as acceptable (crypto/tls would otherwise send none, and the
	// refusal would be the client's), trusting the bundle of the moment,
	// and reads: a listener that admitted it speaks first (gRPC's HTTP/2
	// settings), one that refused it sends its alert, which crypto/tls
	// reports at the read (a gRPC client may see only the broken pipe).
	probeOld := func() error {
		cert, err := tls.LoadX509KeyPair(oldCli.Cert, oldCli.Key)
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(oldCli.CA)
		if err != nil {
			t.Fatal(err)
		}
		roots := x509.NewCertPool()
		roots.AppendCertsFromPEM(b)
		conn, err := tls.Dial("tcp", addr, &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: roots, ServerName: "127.0.0.1", NextProtos: []string{"h2"},
			GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &cert, nil }})
		if err != nil {
			return err
		}
		defer conn.Close()
		_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err = conn.Read(make([]byte, 64))
		return err
	}
	// serverLeaf is the certificate the listener presents to a new
	// handshake now.
	serverLeaf := func() *x509.Certificate {
		t.Helper()
		tc, err := cliFiles.Client("tls")
		if err != nil {
			t.Fatal(err)
		}
		tc.ServerName = "127.0.0.1"
		c, err := tls.Dial("tcp", addr, tc)
		if err != nil {
			t.Fatalf("handshake with the listener: %v", err)
		}
		defer c.Close()
		return c.ConnectionState().PeerCertificates[0]
	}
	fileCert := func(path string) *x509.Certificate {
		t.Helper()
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		certs, err := pki.ParseCertificates(b)
		if err != nil {
			t.Fatal(err)
		}
		return certs[0]
	}

	// The caller that must never fail: one long-lived connection, and a
	// fresh connection (a full handshake with the files of the moment)
	// every few calls.
	// Both use one config made now, as a daemon does: its credentials read
	// the files at each handshake.
	tc0, err := cliFiles.Client("tls")
	if err != nil {
		t.Fatal(err)
	}
	creds0 := serve.ClientCredentials(tc0)
	freshCall := func() error {
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds0))
		if err != nil {
			return err
		}
		defer conn.Close()
		return check(conn)
	}
	long, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds0))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { long.Close() })
	var calls, fresh, failures atomic.Int64
	var firstErr atomic.Value
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(2 * time.Millisecond):
			}
			var err error
			if i%4 == 0 {
				err = freshCall()
				fresh.Add(1)
			} else {
				err = check(long)
			}
			calls.Add(1)
			if err != nil {
				failures.Add(1)
				firstErr.CompareAndSwap(nil, err)
			}
		}
	}()
	settle := func() { time.Sleep(100 * time.Millisecond) } // a few calls per step

	settle()
	leaf0 := serverLeaf()

	// 1. Reissue of the leaves: the listener presents the new one.
	srvFiles, cliFiles = issue(ca)
	settle()
	if leaf := serverLeaf(); leaf.SerialNumber.Cmp(leaf0.SerialNumber) == 0 || !leaf.Equal(fileCert(srvFiles.Cert)) {
		t.Fatalf("after the reissue the listener presents serial %x, want the new file's %x", leaf.SerialNumber, fileCert(srvFiles.Cert).SerialNumber)
	}
	t.Logf("reissue: the listener presents the new certificate (serial %x, was %x)", serverLeaf().SerialNumber, leaf0.SerialNumber)

	// A certificate file that does not load (garbage, or a certificate
	// whose key is not there yet) is ignored: the last good one serves.
	good, err := os.ReadFile(srvFiles.Cert)
	if err != nil {
		t.Fatal(err)
	}
	goodCert := fileCert(srvFiles.Cert)
	if err := os.WriteFile(srvFiles.Cert, []byte("not a certificate"), 0o644); err != nil {
		t.Fatal(err)
	}
	settle()
	if leaf := serverLeaf(); !leaf.Equal(goodCert) {
		t.Fatalf("with a broken certificate file the listener presents serial %x, want the last good one %x", leaf.SerialNumber, goodCert.SerialNumber)
	}
	t.Logf("broken certificate file: the listener still presents serial %x", goodCert.SerialNumber)
	if err := os.WriteFile(srvFiles.Cert, good, 0o644); err != nil {
		t.Fatal(err)
	}

	// 2. CA rotation: the next CA joins the bundle, then signs; the
	// leaves are reissued by it.
	next, err := pki.BeginRotation(dir, "test CA")
	if err != nil {
		t.Fatal(err)
	}
	settle()
	newCA, err := pki.PromoteRotation(dir)
	if err != nil {
		t.Fatal(err)
	}
	if !newCA.Cert.Equal(next) {
		t.Fatal("the promoted CA is not the one BeginRotation made")
	}
	if err := pki.FinishRotation(dir, srvFiles.Cert, cliFiles.Cert); err == nil {
		t.Fatal("FinishRotation with certificates of the old CA: no error")
	} else {
		t.Logf("finish before the reissue: refused: %v", err)
	}
	srvFiles, cliFiles = issue(newCA)
	settle()
	if err := serverLeaf().CheckSignatureFrom(newCA.Cert); err != nil {
		t.Fatalf("after the CA rotation the listener's certificate is not the new CA's: %v", err)
	}
	t.Logf("CA rotation: the listener presents a certificate of the new CA %q", newCA.Cert.Subject.CommonName)
	// Control for the client side: the same config made before the
	// rotation, dialled with plain credentials.NewTLS (trust as read then),
	// refuses the new CA's server certificate; ClientCredentials accepts it.
	plainConn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(tc0)))
	if err != nil {
		t.Fatal(err)
	}
	err = check(plainConn)
	plainConn.Close()
	if err == nil || !strings.Contains(err.Error(), "unknown authority") {
		t.Fatalf("control: the pre-rotation config without ClientCredentials: %v, want the new CA refused", err)
	}
	t.Logf("control: the pre-rotation config without ClientCredentials: %v", err)
	if err := freshCall(); err != nil {
		t.Fatalf("the pre-rotation config with ClientCredentials: %v", err)
	}
	// A copy of that config with a check of its own (as a check of the
	// server's role adds) follows the files too, and its check runs.
	var checked atomic.Int64
	clone := tc0.Clone()
	clone.VerifyConnection = func(tls.ConnectionState) error { checked.Add(1); return nil }
	cloneConn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(serve.ClientCredentials(clone)))
	if err != nil {
		t.Fatal(err)
	}
	err = check(cloneConn)
	cloneConn.Close()
	if err != nil || checked.Load() == 0 {
		t.Fatalf("a copy of the pre-rotation config with its own check: %v (check ran %d times)", err, checked.Load())
	}

	// Control: before the old CA is dropped, its certificate is admitted.
	if err := probeOld(); err != nil {
		t.Fatalf("control: a client with the old CA's certificate before the drop: %v", err)
	}
	t.Log("control: a client with the old CA's certificate is admitted while the bundle holds the old CA")

	// 3. The old CA leaves the bundle.
	if err := pki.FinishRotation(dir, srvFiles.Cert, cliFiles.Cert); err != nil {
		t.Fatal(err)
	}
	if b, err := pki.Bundle(dir); err != nil || len(b) != 1 || !b[0].Equal(newCA.Cert) {
		t.Fatalf("bundle after the drop: %d CAs, %v; want the new CA only", len(b), err)
	}
	err = probeOld()
	if err == nil || !strings.Contains(err.Error(), "unknown certificate authority") {
		t.Fatalf("a client with the old CA's certificate after the drop: %v, want a refused handshake", err)
	}
	t.Logf("after the drop, a client with the old CA's certificate: %v", err)
	if err := probe(cliFiles); err != nil {
		t.Fatalf("a client with the new CA's certificate after the drop: %v", err)
	}

	settle()
	close(stop)
	wg.Wait()
	t.Logf("background caller: %d calls (%d on fresh connections), %d failed", calls.Load(), fresh.Load(), failures.Load())
	if failures.Load() != 0 || fresh.Load() == 0 {
		t.Fatalf("%d of %d calls failed across the rotations (first: %v)", failures.Load(), calls.Load(), firstErr.Load())
	}
}

// TestServerCertReload: a listener for clients without certificates (the
// E2B API's, cubeproxy's with files) presents the certificate its files
// hold at each handshake: replaced files are served without a restart.
func TestServerCertReload(t *testing.T) {
	dir := t.TempDir()
	ca, err := pki.NewCA("test CA")
	if err != nil {
		t.Fatal(err)
	}
	f, err := ca.Issue(dir, "api", "api", pki.RoleMaster, "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	tc, err := serve.ServerCert("api.e2b_tls_cert", f.Cert, f.Key)
	if err != nil {
		t.Fatal(err)
	}
	l, err := tls.Listen("tcp", "127.0.0.1:0", tc)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			_ = c.(*tls.Conn).Handshake()
			c.Close()
		}
	}()
	served := func() *x509.Certificate {
		t.Helper()
		c, err := tls.Dial("tcp", l.Addr().String(), &tls.Config{InsecureSkipVerify: true})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		return c.ConnectionState().PeerCertificates[0]
	}
	first := served()
	if _, err := ca.Issue(dir, "api", "api", pki.RoleMaster, "127.0.0.1"); err != nil {
		t.Fatal(err)
	}
	second := served()
	if first.Equal(second) {
		t.Fatal("the listener presents the same certificate after its files were replaced")
	}
	t.Logf("serial %x, then %x after the files were replaced", first.SerialNumber, second.SerialNumber)
}
