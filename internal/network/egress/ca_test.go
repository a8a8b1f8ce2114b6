package egress

import (
	"crypto/x509"
	"os"
	"path/filepath"
	"testing"
)

// The CA is made once (key 0600) and read back the same; its leaves
// verify for their name only.
func TestCA(t *testing.T) {
	dir := t.TempDir()
	ca, err := LoadOrCreateCA(dir)
	if err != nil {
		t.Fatal(err)
	}
	again, err := LoadOrCreateCA(dir)
	if err != nil || !again.Cert.Equal(ca.Cert) {
		t.Fatalf("second load: %v", err)
	}
	if fi, err := os.Stat(filepath.Join(dir, CAKeyFile)); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("key file: %v %v", fi, err)
	}
	leaf, err := ca.Leaf("api.openai.com")
	if err != nil {
		t.Fatal(err)
	}
	if cached, _ := ca.Leaf("api.openai.com"); cached != leaf {
		t.Error("leaf not cached")
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca.Cert)
	if _, err := leaf.Leaf.Verify(x509.VerifyOptions{DNSName: "api.openai.com", Roots: roots}); err != nil {
		t.Fatalf("leaf does not verify: %v", err)
	}
	if _, err := leaf.Leaf.Verify(x509.VerifyOptions{DNSName: "evil.example", Roots: roots}); err == nil {
		t.Fatal("leaf verifies for another name")
	}
	// Half a CA (one file lost) is an error, not a silent new CA that
	// sandboxes do not trust.
	if err := os.Remove(filepath.Join(dir, CAKeyFile)); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadOrCreateCA(dir); err == nil {
		t.Fatal("a CA without its key loaded")
	}
}

func TestHostOnly(t *testing.T) {
	for in, want := range map[string]string{"API.Example.com:443": "api.example.com", "example.com.": "example.com",
		"198.51.100.1:80": "198.51.100.1", "x": "x"} {
		if got := hostOnly(in); got != want {
			t.Errorf("hostOnly(%q) = %q, want %q", in, got, want)
		}
	}
}
