package pki_test

import (
	"errors"
	"path/filepath"
	"testing"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/pki"
)

// TestRotationSteps: the steps of a CA rotation in order change the
// bundle as documented, and each out of order is refused
// (FailedPrecondition) with the bundle unchanged.
func TestRotationSteps(t *testing.T) {
	dir := t.TempDir()
	if _, err := pki.BeginRotation(dir, "x"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("begin without a CA: %v, want NotFound", err)
	}
	old, err := pki.LoadOrCreateCA(dir, "test CA")
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := old.Issue(dir, "node", "node-1", pki.RoleNode, "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	bundle := func() []string {
		t.Helper()
		b, err := pki.Bundle(dir)
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, c := range b {
			names = append(names, c.Subject.CommonName)
		}
		return names
	}
	refused := func(step string, err error) {
		t.Helper()
		before := bundle()
		if !errors.Is(err, errdefs.ErrFailedPrecondition) {
			t.Fatalf("%s: %v, want FailedPrecondition", step, err)
		}
		t.Logf("%s: refused: %v", step, err)
		if after := bundle(); len(after) != len(before) {
			t.Fatalf("%s changed the bundle: %v -> %v", step, before, after)
		}
	}
	_, err = pki.PromoteRotation(dir)
	refused("promote before begin", err)

	next, err := pki.BeginRotation(dir, "test CA")
	if err != nil {
		t.Fatal(err)
	}
	if b := bundle(); len(b) != 2 || b[0] != "test CA" || b[1] != next.Subject.CommonName {
		t.Fatalf("bundle after begin: %v, want the old CA then the next", b)
	}
	_, err = pki.BeginRotation(dir, "test CA")
	refused("begin twice", err)
	refused("finish before promote", pki.FinishRotation(dir))
	// The old CA still signs until the promotion.
	if ca, err := pki.LoadCA(dir); err != nil || !ca.Cert.Equal(old.Cert) {
		t.Fatalf("signing CA after begin: %v, want the old one", err)
	}

	newCA, err := pki.PromoteRotation(dir)
	if err != nil {
		t.Fatal(err)
	}
	if b := bundle(); len(b) != 2 || b[0] != next.Subject.CommonName || b[1] != "test CA" {
		t.Fatalf("bundle after promote: %v, want the new CA then the old", b)
	}
	if ca, err := pki.LoadCA(dir); err != nil || !ca.Cert.Equal(next) {
		t.Fatalf("signing CA after promote: %v, want the next one", err)
	}
	// Issue keeps the bundle whole (the components still trust both).
	if _, err := newCA.Issue(dir, "master", "cubemaster", pki.RoleMaster); err != nil {
		t.Fatal(err)
	}
	if b := bundle(); len(b) != 2 {
		t.Fatalf("bundle after an issue: %v", b)
	}
	refused("finish with node.crt of the old CA", pki.FinishRotation(dir, leaf.Cert, filepath.Join(dir, "master.crt")))
	if _, err := newCA.Issue(dir, "node", "node-1", pki.RoleNode, "127.0.0.1"); err != nil {
		t.Fatal(err)
	}
	if err := pki.FinishRotation(dir, leaf.Cert, filepath.Join(dir, "master.crt")); err != nil {
		t.Fatal(err)
	}
	if b := bundle(); len(b) != 1 || b[0] != next.Subject.CommonName {
		t.Fatalf("bundle after finish: %v, want the new CA only", b)
	}
}
