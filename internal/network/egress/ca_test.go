package egress

import (
	"crypto/x509"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
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

// TestCACreationRaces: eight processes' worth of LoadOrCreateCA on one
// empty dir (master replicas on a shared dir) all end with the same CA,
// and the files on disk are that pair.
func TestCACreationRaces(t *testing.T) {
	dir := t.TempDir()
	const n = 8
	cas := make([]*CA, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { cas[i], errs[i] = LoadOrCreateCA(dir) })
	}
	wg.Wait()
	for i := range n {
		if errs[i] != nil || !cas[i].Cert.Equal(cas[0].Cert) {
			t.Fatalf("creator %d: %v (same CA: %v)", i, errs[i], errs[i] == nil && cas[i].Cert.Equal(cas[0].Cert))
		}
	}
	disk, err := LoadOrCreateCA(dir)
	if err != nil || !disk.Cert.Equal(cas[0].Cert) {
		t.Fatalf("on disk: %v", err)
	}
	left, _ := filepath.Glob(filepath.Join(dir, ".egress-ca*"))
	if len(left) != 0 {
		t.Fatalf("temporary files left: %v", left)
	}
	t.Logf("%d concurrent creators: one CA (%s)", n, cas[0].Cert.Subject.CommonName)
}

// TestCAHalfWritten: a key without its cert (a creation cut between its
// two links) is refused with an error that says what to remove, and is
// not replaced by a new pair; the control is the same dir once the key
// is removed, where a CA is made.
func TestCAHalfWritten(t *testing.T) {
	dir := t.TempDir()
	_, keyPEM, err := newCA()
	if err != nil {
		t.Fatal(err)
	}
	keyPath := filepath.Join(dir, CAKeyFile)
	if err := os.WriteFile(keyPath, keyPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	old := caSettle
	caSettle = 100 * time.Millisecond
	t.Cleanup(func() { caSettle = old })
	_, err = LoadOrCreateCA(dir)
	if err == nil || !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "remove "+keyPath) {
		t.Fatalf("a key without its cert: %v, want a refusal naming the file to remove", err)
	}
	if _, serr := os.Stat(filepath.Join(dir, CACertFile)); !errors.Is(serr, os.ErrNotExist) {
		t.Fatalf("a cert was written beside the half pair: %v", serr)
	}
	t.Logf("key without cert: %v", err)
	if err := os.Remove(keyPath); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadOrCreateCA(dir); err != nil {
		t.Fatalf("control, the key removed: %v", err)
	}
	t.Log("control: with the half pair removed a CA is made")
}
