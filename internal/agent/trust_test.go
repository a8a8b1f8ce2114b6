package agent

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func testCADER(t *testing.T) []byte {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "egress test CA"},
		NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return der
}

// A Debian-like image: the CA is appended to its bundle once (a second
// start, as after a restore, adds nothing), reached through the bundle's
// symlinked other name, and kept apart for NODE_EXTRA_CA_CERTS; the
// image's own certificates stay.
func TestInstallCA(t *testing.T) {
	root := t.TempDir()
	der := testCADER(t)
	bundle := filepath.Join(root, "etc/ssl/certs/ca-certificates.crt")
	if err := os.MkdirAll(filepath.Dir(bundle), 0o755); err != nil {
		t.Fatal(err)
	}
	orig := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: testCADER(t)})
	if err := os.WriteFile(bundle, orig, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("certs/ca-certificates.crt", filepath.Join(root, "etc/ssl/cert.pem")); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		got, err := InstallCA(root, der)
		if err != nil || got != "/etc/ssl/certs/ca-certificates.crt" {
			t.Fatalf("InstallCA = %q, %v", got, err)
		}
	}
	body, _ := os.ReadFile(bundle)
	block := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	if !bytes.HasPrefix(body, orig) || bytes.Count(body, block) != 1 {
		t.Fatalf("bundle:\n%s", body)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(body) {
		t.Fatal("bundle does not parse")
	}
	if own, _ := os.ReadFile(filepath.Join(root, EgressCAFile)); !bytes.Equal(own, block) {
		t.Fatalf("%s: %q", EgressCAFile, own)
	}
	if env := TrustEnv("/b"); env["SSL_CERT_FILE"] != "/b" || env["NODE_EXTRA_CA_CERTS"] != "/"+EgressCAFile {
		t.Fatalf("TrustEnv %v", env)
	}
}

// An image without any bundle gets one holding the CA; garbage is refused.
func TestInstallCANoBundle(t *testing.T) {
	root := t.TempDir()
	got, err := InstallCA(root, testCADER(t))
	if err != nil || got != "/"+DefaultTrustBundle {
		t.Fatalf("InstallCA = %q, %v", got, err)
	}
	body, _ := os.ReadFile(filepath.Join(root, DefaultTrustBundle))
	if !x509.NewCertPool().AppendCertsFromPEM(body) {
		t.Fatalf("bundle %q", body)
	}
	if _, err := InstallCA(t.TempDir(), []byte("not a certificate")); err == nil {
		t.Fatal("garbage accepted")
	}
}
