package launcher

import (
	"crypto/tls"
	"crypto/x509"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	toml "github.com/pelletier/go-toml/v2"

	"github.com/cubesandbox/cube/internal/pki"
)

// TestDomainModeConfig: cube up --domain-mode gives cubemaster a route
// with TLS and the API at api.<domain>, a certificate of the cluster CA
// that verifies for api.<domain> and every <port>-<id>.<domain> (and not
// for another domain: the control), that no cluster listener takes as a
// caller, and an environment with E2B_DOMAIN and the CA but no URL.
func TestDomainModeConfig(t *testing.T) {
	dir := t.TempDir()
	cfg := Config{StateDir: filepath.Join(dir, "state"), RunDir: filepath.Join(dir, "run"), LogDir: filepath.Join(dir, "log"),
		APIAddr: "127.0.0.1:3000", ProxyAddr: "127.0.0.1:8443", DomainMode: true, Template: "busybox",
		ExtraCubeletTOML: "[node]\nid = \"n1\"\n", Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if err := os.MkdirAll(cfg.launcherDir(), 0o700); err != nil {
		t.Fatal(err)
	}
	if got := cfg.domain(); got != "cube.localhost:8443" {
		t.Fatalf("domain %q, want cube.localhost:8443", got)
	}
	masterPath, _, err := cfg.writeConfigs(false)
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(masterPath)
	if err != nil {
		t.Fatal(err)
	}
	var m struct {
		Proxy struct {
			Listen, Domain string
			API            bool   `toml:"api"`
			TLSCert        string `toml:"tls_cert"`
			TLSKeyFile     string `toml:"tls_key"`
		} `toml:"proxy"`
	}
	if err := toml.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	if !m.Proxy.API || m.Proxy.Domain != "cube.localhost:8443" || m.Proxy.Listen != "127.0.0.1:8443" || m.Proxy.TLSCert == "" || m.Proxy.TLSKeyFile == "" {
		t.Fatalf("cubemaster [proxy]: %+v\n%s", m.Proxy, b)
	}
	pair, err := tls.LoadX509KeyPair(m.Proxy.TLSCert, m.Proxy.TLSKeyFile)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	caPEM, err := os.ReadFile(cfg.routeCACert())
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(caPEM)
	for _, name := range []string{"api.cube.localhost", "49983-abc.cube.localhost", "127.0.0.1"} {
		if _, err := leaf.Verify(x509.VerifyOptions{DNSName: name, Roots: roots}); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	// The control: the same certificate and CA for a name outside the domain.
	if _, err := leaf.Verify(x509.VerifyOptions{DNSName: "api.evil.test", Roots: roots}); err == nil {
		t.Error("verified for api.evil.test")
	}
	// The route CA signs for its domain only: a certificate it issues for
	// another site does not verify with it (its name constraints), while
	// one for a name under the domain does (the control). And the cluster
	// CA, which signs the components' identities, is not what clients
	// are told to trust.
	rca, err := pki.LoadOrCreateRouteCA(cfg.routeCADir(), "", "")
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]bool{"www.bank.test": false, "x.cube.localhost": true} {
		f, err := rca.Issue(t.TempDir(), "site", name, pki.RoleRoute, name)
		if err != nil {
			t.Fatal(err)
		}
		kp, err := tls.LoadX509KeyPair(f.Cert, f.Key)
		if err != nil {
			t.Fatal(err)
		}
		c, _ := x509.ParseCertificate(kp.Certificate[0])
		_, err = c.Verify(x509.VerifyOptions{DNSName: name, Roots: roots})
		t.Logf("route CA's certificate for %s: %v", name, err)
		if (err == nil) != want {
			t.Errorf("a route CA certificate for %s verifies: %v, want %v", name, err == nil, want)
		}
	}
	if cluster, err := os.ReadFile(filepath.Join(cfg.pkiDir(), pki.CACertFile)); err == nil && string(cluster) == string(caPEM) {
		t.Error("clients are told to trust the cluster CA")
	}
	if err := pki.CheckPeer(leaf, "", pki.RoleMaster, pki.RoleNode, pki.RoleProxy, pki.RoleAdmin); err == nil {
		t.Error("the route's certificate passes as a cluster component")
	}
	// The control: a proxy's certificate of the same CA passes the check.
	ca, err := pki.LoadOrCreateCA(cfg.pkiDir(), "")
	if err != nil {
		t.Fatal(err)
	}
	pf, err := ca.Issue(t.TempDir(), "proxy", "p1", pki.RoleProxy)
	if err != nil {
		t.Fatal(err)
	}
	pp, err := tls.LoadX509KeyPair(pf.Cert, pf.Key)
	if err != nil {
		t.Fatal(err)
	}
	pleaf, _ := x509.ParseCertificate(pp.Certificate[0])
	if err := pki.CheckPeer(pleaf, "", pki.RoleMaster, pki.RoleNode, pki.RoleProxy, pki.RoleAdmin); err != nil {
		t.Errorf("control: a proxy certificate is refused: %v", err)
	}
	bundle, err := os.ReadFile(cfg.caBundle())
	if err != nil || !strings.Contains(string(bundle), string(caPEM)) {
		t.Errorf("CA bundle lacks the cluster CA: %v", err)
	}
	env := map[string]string{}
	for _, v := range cfg.environment("key") {
		env[v.Name] = v.Value
	}
	if env["E2B_DOMAIN"] != "cube.localhost:8443" || env["E2B_API_URL"] != "" || env["E2B_SANDBOX_URL"] != "" ||
		env["NODE_EXTRA_CA_CERTS"] == "" || env["SSL_CERT_FILE"] != cfg.caBundle() {
		t.Errorf("environment %v", env)
	}
}
