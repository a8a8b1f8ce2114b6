package launcher

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/pki"
)

// TestPKISteps: `cube pki` on a state directory as `cube up` leaves it:
// reissue replaces the three certificates from the same CA; the CA steps
// in order end with a bundle of the new CA and every certificate signed
// by it; finish before the reissue of a certificate is refused. What each
// step printed is logged.
func TestPKISteps(t *testing.T) {
	cfg := Config{StateDir: t.TempDir()}
	var out bytes.Buffer
	if err := PKI(cfg, PKIStatus, &out); err == nil {
		t.Fatal("status without a CA: no error")
	}
	if err := os.MkdirAll(cfg.launcherDir(), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(cfg.launcherDir(), "cubelet.toml"), []byte("[node]\nid = \"node-7\"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := cfg.certificates("node-7"); err != nil { // cube up's first start
		t.Fatal(err)
	}
	leaf := func(f string) []byte {
		b, err := os.ReadFile(filepath.Join(cfg.pkiDir(), f))
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	signedBy := func(f string, ca *pki.CA) bool {
		certs, err := pki.ParseCertificates(leaf(f))
		if err != nil {
			t.Fatal(err)
		}
		return certs[0].CheckSignatureFrom(ca.Cert) == nil
	}
	run := func(step string) {
		t.Helper()
		out.Reset()
		if err := PKI(cfg, step, &out); err != nil {
			t.Fatalf("cube pki %s: %v", step, err)
		}
		t.Logf("cube pki %s:\n%s", step, out.String())
	}
	oldCA, err := pki.LoadCA(cfg.pkiDir())
	if err != nil {
		t.Fatal(err)
	}
	before := map[string][]byte{}
	for _, f := range leafFiles {
		before[f] = leaf(f)
	}
	run(PKIReissue)
	for _, f := range leafFiles {
		if bytes.Equal(before[f], leaf(f)) || !signedBy(f, oldCA) {
			t.Fatalf("reissue: %s unchanged or not signed by the CA", f)
		}
	}
	if certs, _ := pki.ParseCertificates(leaf("node.crt")); certs[0].Subject.CommonName != "node-7" {
		t.Fatalf("reissued node certificate names %q, want the node ID", certs[0].Subject.CommonName)
	}
	run(PKICABegin)
	if err := PKI(cfg, PKICAFinish, &out); err == nil {
		t.Fatal("ca-finish right after ca-begin: no error")
	}
	run(PKICAPromote)
	newCA, err := pki.LoadCA(cfg.pkiDir())
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range leafFiles {
		if !signedBy(f, newCA) {
			t.Fatalf("ca-promote: %s not signed by the new CA", f)
		}
	}
	if !strings.Contains(out.String(), "rotation under way") {
		t.Fatalf("status after ca-promote does not say a rotation is under way:\n%s", out.String())
	}
	run(PKICAFinish)
	if b, err := pki.Bundle(cfg.pkiDir()); err != nil || len(b) != 1 || !b[0].Equal(newCA.Cert) || b[0].Equal(oldCA.Cert) {
		t.Fatalf("bundle after ca-finish: %v", err)
	}
	if err := PKI(cfg, "rotate", &out); err == nil {
		t.Fatal("an unknown step: no error")
	}
}
