package pki_test

import (
	"crypto/tls"
	"crypto/x509"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/cubesandbox/cube/internal/pki"
)

// TestCAAndIssue: the CA is made once and read back the same; its key and
// the issued keys are 0600 whatever the umask; an issued certificate
// verifies against the CA for server and client use, names the component
// and its role, and its hosts.
func TestCAAndIssue(t *testing.T) {
	old := syscall.Umask(0)
	t.Cleanup(func() { syscall.Umask(old) })
	dir := filepath.Join(t.TempDir(), "ca")
	ca, err := pki.LoadOrCreateCA(dir, "test cluster")
	if err != nil {
		t.Fatal(err)
	}
	again, err := pki.LoadOrCreateCA(dir, "ignored")
	if err != nil {
		t.Fatal(err)
	}
	if !again.Cert.Equal(ca.Cert) {
		t.Fatal("a second LoadOrCreateCA made a new CA")
	}
	for _, p := range []string{dir, filepath.Join(dir, pki.CAKeyFile)} {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm()&0o077 != 0 {
			t.Errorf("%s is %v under umask 0, want no access for group and others", p, fi.Mode())
		}
	}
	if err := os.Remove(filepath.Join(dir, pki.CAKeyFile)); err != nil {
		t.Fatal(err)
	}
	if _, err := pki.LoadOrCreateCA(dir, "test cluster"); err == nil {
		t.Fatal("a CA directory holding a certificate without its key was replaced by a new CA")
	}

	files, err := again.Issue(filepath.Join(t.TempDir(), "node"), "node", "node-7", pki.RoleNode, "10.0.0.7", "node-7.example")
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(files.Key); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("key %v, %v: want 0600", fi.Mode(), err)
	}
	pair, err := tls.LoadX509KeyPair(files.Cert, files.Key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	if cert.Subject.CommonName != "node-7" || len(cert.Subject.OrganizationalUnit) != 1 || cert.Subject.OrganizationalUnit[0] != string(pki.RoleNode) {
		t.Errorf("subject %v, want CN node-7, OU node", cert.Subject)
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca.Cert)
	for _, usage := range []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth} {
		for _, host := range []string{"10.0.0.7", "node-7.example"} {
			if _, err := cert.Verify(x509.VerifyOptions{Roots: roots, DNSName: host, KeyUsages: []x509.ExtKeyUsage{usage}}); err != nil {
				t.Errorf("verify for %s, usage %v: %v", host, usage, err)
			}
		}
	}
	if _, err := cert.Verify(x509.VerifyOptions{Roots: roots, DNSName: "10.0.0.8"}); err == nil {
		t.Error("the certificate verified for a host it does not name")
	}
	other, err := pki.NewCA("other")
	if err != nil {
		t.Fatal(err)
	}
	otherRoots := x509.NewCertPool()
	otherRoots.AddCert(other.Cert)
	if _, err := cert.Verify(x509.VerifyOptions{Roots: otherRoots}); err == nil {
		t.Error("the certificate verified against another CA")
	}
}
