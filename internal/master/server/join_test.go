package server_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/durationpb"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/server"
	"github.com/cubesandbox/cube/internal/network/egress"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/nodejoin"
	"github.com/cubesandbox/cube/internal/pki"
	"github.com/cubesandbox/cube/internal/serve"
	"github.com/cubesandbox/cube/internal/testenv"
)

// TestJoin: a node spends a one-time join token for a node certificate
// of the cluster CA, made for a key it keeps. Each refusal has its
// control: a wrong secret (the right one works), a spent token (its first
// use worked), an expired one (a fresh one works), a token for any node
// used for a registered node's ID (a token made for that ID works), and a
// listener whose CA is not the token's (the same token then works on the
// real one: it was never sent).
func TestJoin(t *testing.T) {
	caDir := t.TempDir()
	ca, err := pki.LoadOrCreateCA(caDir, "join test CA")
	if err != nil {
		t.Fatal(err)
	}
	cfg := config(t, func(c *master.Config) {
		c.Join.Listen, c.Join.CADir = "127.0.0.1:0", caDir
	})
	s, err := server.Start(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Stop() })
	ctx := context.Background()
	conn, err := grpc.NewClient("unix://"+cfg.API.Socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	admin := masterpb.NewAdminServiceClient(conn)
	token := func(nodeID string, ttl time.Duration) string {
		t.Helper()
		resp, err := admin.CreateJoinToken(ctx, &masterpb.CreateJoinTokenRequest{NodeId: nodeID, Ttl: durationpb.New(ttl)})
		if err != nil {
			t.Fatal(err)
		}
		return resp.Token
	}
	join := func(tok, nodeID string) error {
		cert, _, caFile, err := nodejoin.Join(ctx, s.JoinAddr, tok, nodeID, []string{"10.1.2.3", "node.example"}, t.TempDir())
		if err != nil {
			return err
		}
		// What a node gets is usable: a node certificate for its ID from
		// the cluster CA, with the key it made, loadable as cubelet's [tls].
		if _, err := (serve.TLSFiles{Cert: cert, Key: strings.TrimSuffix(cert, ".crt") + ".key", CA: caFile}).MutualServer("tls"); err != nil {
			return err
		}
		pair, err := tls.LoadX509KeyPair(cert, strings.TrimSuffix(cert, ".crt")+".key")
		if err != nil {
			return err
		}
		leaf, err := x509.ParseCertificate(pair.Certificate[0])
		if err != nil {
			return err
		}
		if leaf.Subject.CommonName != nodeID || leaf.Subject.OrganizationalUnit[0] != string(pki.RoleNode) || leaf.CheckSignatureFrom(ca.Cert) != nil {
			t.Fatalf("joined %s: certificate %v", nodeID, leaf.Subject)
		}
		return nil
	}

	good := token("", time.Hour)
	parts := strings.Split(good, ".")
	wrong := strings.Join([]string{parts[0], parts[1], strings.Repeat("0", len(parts[2])), parts[3]}, ".")
	if err := join(wrong, "node-a"); !errdefs.IsUnauthenticated(err) {
		t.Fatalf("wrong secret: %v, want Unauthenticated", err)
	} else {
		t.Logf("wrong secret: %v", err)
	}
	// Another CA's hash: the node refuses the listener before sending.
	other, err := pki.NewCA("other")
	if err != nil {
		t.Fatal(err)
	}
	pinned := strings.Join([]string{parts[0], parts[1], parts[2], master.CAHash(other)}, ".")
	if err := join(pinned, "node-a"); err == nil || !strings.Contains(err.Error(), "not the one the token names") {
		t.Fatalf("listener of another CA than the token's: %v", err)
	} else {
		t.Logf("listener's CA not the token's: %v", err)
	}
	if err := join(good, "node-a"); err != nil {
		t.Fatalf("control: the right token: %v", err)
	}
	t.Log("control: node-a joined with the token (unspent by the refusals above)")
	if err := join(good, "node-b"); !errdefs.IsUnauthenticated(err) {
		t.Fatalf("a spent token: %v, want Unauthenticated", err)
	} else {
		t.Logf("the same token again: %v", err)
	}

	short := token("", 50*time.Millisecond)
	time.Sleep(200 * time.Millisecond)
	if err := join(short, "node-c"); !errdefs.IsUnauthenticated(err) {
		t.Fatalf("an expired token: %v, want Unauthenticated", err)
	}
	if err := join(token("", time.Hour), "node-c"); err != nil {
		t.Fatalf("control: a fresh token: %v", err)
	}
	t.Log("expired token refused; a fresh one joins node-c")

	// A registered node: a token for any node may not mint its identity.
	if err := s.Service.Register(ctx, &masterpb.NodeReport{NodeId: "node-r", Address: "127.0.0.1:1", BootId: "b"}); err != nil {
		t.Fatal(err)
	}
	if err := join(token("", time.Hour), "node-r"); !errdefs.IsUnauthenticated(err) {
		t.Fatalf("any-node token for registered node-r: %v, want Unauthenticated", err)
	}
	if err := join(token("node-r", time.Hour), "node-r"); err != nil {
		t.Fatalf("control: a token made for node-r: %v", err)
	}
	// And a token made for one node is not another's.
	if err := join(token("node-r", time.Hour), "node-s"); !errdefs.IsUnauthenticated(err) {
		t.Fatalf("node-r's token for node-s: %v, want Unauthenticated", err)
	}
	t.Log("registered node-r: an any-node token refused, node-r's own joins; node-r's token refused for node-s")

	// The listener: plaintext gets no answer of the handler.
	resp, err := http.Post("http://"+s.JoinAddr+nodejoin.Path, "application/json", strings.NewReader("{}"))
	if err == nil {
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			t.Fatal("plaintext join answered 200")
		}
	}
}

// TestJoinRefusalsLimited: a client whose joins keep being refused (a
// token guesser) is answered 429 once it has used its allowance of
// refusals, before the listener reads the catalog. The control: the same
// request from another address still reaches the token check (401).
func TestJoinRefusalsLimited(t *testing.T) {
	caDir := t.TempDir()
	if _, err := pki.LoadOrCreateCA(caDir, "join test CA"); err != nil {
		t.Fatal(err)
	}
	cfg := config(t, func(c *master.Config) {
		c.Join.Listen, c.Join.CADir = "127.0.0.1:0", caDir
	})
	s, err := server.Start(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Stop() })
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := json.Marshal(nodejoin.Request{Token: "cjt1.guess.000000.x", NodeID: "node-g", Hosts: []string{"10.1.2.3"},
		PublicKey: string(pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der}))})
	from := func(ip string) int {
		t.Helper()
		tr := &http.Transport{
			DialContext: (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}).DialContext,
			// The listener's identity is not what this test checks
			// (TestJoin does): any certificate will do.
			TLSClientConfig: &tls.Config{InsecureSkipVerify: true},
		}
		defer tr.CloseIdleConnections()
		resp, err := (&http.Client{Transport: tr, Timeout: 10 * time.Second}).Post("https://"+s.JoinAddr+nodejoin.Path, "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	codes := map[int]int{}
	for range 12 {
		codes[from("127.0.0.1")]++
	}
	t.Logf("12 refused joins from 127.0.0.1: %v", codes)
	if codes[http.StatusUnauthorized] != 10 || codes[http.StatusTooManyRequests] != 2 {
		t.Fatalf("12 guesses from one address answered %v; want 10 refused by the token check, then 429", codes)
	}
	if code := from("127.0.0.2"); code != http.StatusUnauthorized {
		t.Fatalf("control: the same request from 127.0.0.2 answered %d, want 401 from the token check", code)
	}
	// Guesses sent all at once get no more tries than guesses in turn.
	var mu sync.Mutex
	var wg sync.WaitGroup
	burst := map[int]int{}
	for range 30 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			code := from("127.0.0.3")
			mu.Lock()
			burst[code]++
			mu.Unlock()
		}()
	}
	wg.Wait()
	t.Logf("30 concurrent guesses from 127.0.0.3: %v", burst)
	if burst[http.StatusUnauthorized] > 10 || burst[http.StatusUnauthorized]+burst[http.StatusTooManyRequests] != 30 {
		t.Fatalf("30 concurrent guesses answered %v; want at most 10 past the limit", burst)
	}
}

// TestJoinEgressCA: nodes that join one cluster get its one egress CA
// (certificate and key, the key 0600 in a 0700 directory), so a leaf the
// egress proxy of one node shows a sandbox verifies against the CA another
// node's sandboxes trust: a sandbox moved, cloned or restored across
// nodes keeps working through TLS-terminating rules. The control: two
// network-agents that each make their own (the [egress] ca_dir default,
// what nodes do without a join) hold CAs whose leaves the other refuses.
func TestJoinEgressCA(t *testing.T) {
	caDir := t.TempDir()
	if _, err := pki.LoadOrCreateCA(caDir, "join test CA"); err != nil {
		t.Fatal(err)
	}
	cfg := config(t, func(c *master.Config) {
		c.Join.Listen, c.Join.CADir = "127.0.0.1:0", caDir
	})
	s, err := server.Start(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Stop() })
	ctx := context.Background()
	conn, err := grpc.NewClient("unix://"+cfg.API.Socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	admin := masterpb.NewAdminServiceClient(conn)
	// joined is the egress CA a node that joined loads, as its
	// network-agent does from [egress] ca_dir = <dir>/egress; the
	// directory is the second result.
	joinedDir := map[string]string{}
	joined := func(nodeID string) *egress.CA {
		t.Helper()
		tok, err := admin.CreateJoinToken(ctx, &masterpb.CreateJoinTokenRequest{Ttl: durationpb.New(time.Hour)})
		if err != nil {
			t.Fatal(err)
		}
		dir := t.TempDir()
		if _, _, _, err := nodejoin.Join(ctx, s.JoinAddr, tok.Token, nodeID, []string{"10.1.2.3"}, dir); err != nil {
			t.Fatal(err)
		}
		ed := filepath.Join(dir, nodejoin.EgressDir)
		for name, want := range map[string]os.FileMode{ed: 0o700 | os.ModeDir, filepath.Join(ed, nodejoin.EgressKeyFile): 0o600} {
			fi, err := os.Stat(name)
			if err != nil {
				t.Fatal(err)
			}
			if fi.Mode() != want {
				t.Fatalf("%s: mode %v, want %v", name, fi.Mode(), want)
			}
		}
		ca, err := egress.LoadOrCreateCA(ed)
		if err != nil {
			t.Fatal(err)
		}
		joinedDir[nodeID] = ed
		return ca
	}
	// crossVerifies: a leaf a's proxy makes for a name verifies against
	// b's certificate, the one b's sandboxes trust.
	crossVerifies := func(a, b *egress.CA) error {
		leaf, err := a.Leaf("api.example.com")
		if err != nil {
			t.Fatal(err)
		}
		roots := x509.NewCertPool()
		roots.AddCert(b.Cert)
		_, err = leaf.Leaf.Verify(x509.VerifyOptions{DNSName: "api.example.com", Roots: roots})
		return err
	}

	n1, n2 := joined("node-1"), joined("node-2")
	if !bytes.Equal(n1.Cert.Raw, n2.Cert.Raw) {
		t.Fatalf("two joined nodes hold different egress CAs: %q, %q", n1.Cert.Subject, n2.Cert.Subject)
	}
	if err := crossVerifies(n1, n2); err != nil {
		t.Fatalf("node-1's leaf against node-2's egress CA: %v", err)
	}
	if err := crossVerifies(n2, n1); err != nil {
		t.Fatalf("node-2's leaf against node-1's egress CA: %v", err)
	}
	t.Logf("node-1 and node-2 joined: one egress CA %q (serial %x); each one's leaf verifies against the other's", n1.Cert.Subject, n1.Cert.SerialNumber)

	// The master's restart keeps the cluster's CA (it is not made again).
	if err := s.Stop(); err != nil {
		t.Fatal(err)
	}
	if s, err = server.Start(context.Background(), cfg, nil); err != nil {
		t.Fatal(err)
	}
	if n3 := joined("node-3"); !bytes.Equal(n3.Cert.Raw, n1.Cert.Raw) {
		t.Fatal("a node joined after the master restarted holds another egress CA")
	}
	t.Log("after a master restart node-3 joins with the same egress CA")

	// Two network-agents configured as cube join printed ([egress]
	// ca_dir = <dir>/egress) hand their sandboxes the same CA; two with
	// the default ca_dir (the control) hand different ones.
	t.Run("network-agents", func(t *testing.T) {
		agentCA := func(dir string) []byte {
			t.Helper()
			e := nettest.Start(t, nettest.Options{EgressCADir: dir})
			return e.Agent.EgressCA()
		}
		a1, a2 := agentCA(joinedDir["node-1"]), agentCA(joinedDir["node-2"])
		if len(a1) == 0 || !bytes.Equal(a1, a2) {
			t.Fatal("the network-agents of node-1 and node-2 hand sandboxes different egress CAs")
		}
		if !bytes.Equal(a1, n1.PEM) {
			t.Fatal("node-1's network-agent hands sandboxes another CA than the cluster's")
		}
		if bytes.Equal(agentCA(""), agentCA("")) {
			t.Fatal("control: two network-agents with their own egress CA hand the same one")
		}
		t.Log("network-agents of node-1 and node-2 hand sandboxes the cluster's egress CA; control: two with the default ca_dir differ")
	})

	// The control: each network-agent makes its own.
	own1, err := egress.LoadOrCreateCA(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	own2, err := egress.LoadOrCreateCA(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(own1.Cert.Raw, own2.Cert.Raw) {
		t.Fatal("control: two agents' own egress CAs are the same")
	}
	err = crossVerifies(own1, own2)
	if err == nil {
		t.Fatal("control: a leaf of one agent's own CA verified against another's")
	}
	t.Logf("control: agents with their own egress CA: a leaf of one against the other: %v", err)
}

// TestJoinReadOnlyCADir: a join.ca_dir the master cannot write (the Helm
// chart mounts the cluster CA's secret read-only) and that holds no
// egress CA does not stop the master: joins work and hand no egress CA,
// so the node's network-agent keeps making its own. The control: the same
// directory writable gets one made, and the join hands it.
func TestJoinReadOnlyCADir(t *testing.T) {
	testenv.RequireRoot(t, "a read-only bind mount")
	for _, readOnly := range []bool{true, false} {
		caDir := t.TempDir()
		if _, err := pki.LoadOrCreateCA(caDir, "join test CA"); err != nil {
			t.Fatal(err)
		}
		if readOnly {
			if err := unix.Mount(caDir, caDir, "", unix.MS_BIND, ""); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = unix.Unmount(caDir, unix.MNT_DETACH) })
			if err := unix.Mount("", caDir, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
				t.Fatal(err)
			}
		}
		cfg := config(t, func(c *master.Config) {
			c.Join.Listen, c.Join.CADir = "127.0.0.1:0", caDir
		})
		s, err := server.Start(context.Background(), cfg, nil)
		if err != nil {
			t.Fatalf("read-only %v: the master did not start: %v", readOnly, err)
		}
		conn, err := grpc.NewClient("unix://"+cfg.API.Socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		tok, err := masterpb.NewAdminServiceClient(conn).CreateJoinToken(context.Background(), &masterpb.CreateJoinTokenRequest{Ttl: durationpb.New(time.Hour)})
		conn.Close()
		if err != nil {
			t.Fatal(err)
		}
		dir := t.TempDir()
		_, _, _, err = nodejoin.Join(context.Background(), s.JoinAddr, tok.Token, "node-ro", []string{"10.1.2.3"}, dir)
		_ = s.Stop()
		if err != nil {
			t.Fatalf("read-only %v: join: %v", readOnly, err)
		}
		_, statErr := os.Stat(filepath.Join(dir, nodejoin.EgressDir, nodejoin.EgressCAFile))
		if readOnly != errors.Is(statErr, os.ErrNotExist) {
			t.Fatalf("read-only %v: the joined node's egress CA: %v", readOnly, statErr)
		}
		t.Logf("join.ca_dir read-only %v: the master started, the join worked, egress CA handed: %v", readOnly, statErr == nil)
	}
}
