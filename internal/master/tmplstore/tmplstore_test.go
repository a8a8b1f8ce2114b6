package tmplstore_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/random"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/tmplstore"
)

// TestPutChecksDigests: a source layer whose bytes were changed is refused
// on the way into the store and leaves no record or blob under its digest;
// the same image untouched goes in (the control).
func TestPutChecksDigests(t *testing.T) {
	img, err := random.Image(8192, 2)
	if err != nil {
		t.Fatal(err)
	}
	src := filepath.Join(t.TempDir(), "oci")
	p, err := layout.Write(src, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.AppendImage(img); err != nil {
		t.Fatal(err)
	}
	ls, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	d, err := ls[0].Digest()
	if err != nil {
		t.Fatal(err)
	}
	blob := filepath.Join(src, "blobs", "sha256", d.Hex)
	orig, err := os.ReadFile(blob)
	if err != nil {
		t.Fatal(err)
	}
	bad := append([]byte(nil), orig...)
	bad[len(bad)/2] ^= 0xff
	if err := os.WriteFile(blob, bad, 0o644); err != nil {
		t.Fatal(err)
	}
	s := tmplstore.New(t.TempDir())
	fromLayout := func() (tmplstore.Record, error) {
		idx, err := layout.ImageIndexFromPath(src)
		if err != nil {
			t.Fatal(err)
		}
		m, err := idx.IndexManifest()
		if err != nil {
			t.Fatal(err)
		}
		li, err := idx.Image(m.Manifests[0].Digest)
		if err != nil {
			t.Fatal(err)
		}
		return s.Put(li, tmplstore.Record{ID: "x"})
	}
	_, err = fromLayout()
	t.Logf("a layer with one byte flipped: %v", err)
	if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), d.String()) {
		t.Fatalf("Put of a tampered source: %v, want InvalidArgument naming %s", err, d)
	}
	if _, err := s.Get("x"); !errdefs.IsNotFound(err) {
		t.Fatalf("record after a refused Put: %v", err)
	}
	if _, err := os.Stat(s.BlobPath(d.String())); !os.IsNotExist(err) {
		t.Fatalf("the refused blob is in the store: %v", err)
	}
	if err := os.WriteFile(blob, orig, 0o644); err != nil {
		t.Fatal(err)
	}
	rec, err := fromLayout()
	if err != nil {
		t.Fatalf("control: the untouched source: %v", err)
	}
	want, _ := img.Digest()
	if rec.Digest != want.String() {
		t.Fatalf("record digest %s, want %s", rec.Digest, want)
	}

	// The same ID with another image is refused; with the same, a no-op.
	other, err := random.Image(1024, 1)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Put(other, tmplstore.Record{ID: "x"}); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("another image under x: %v", err)
	}
	if _, err := s.Put(img, tmplstore.Record{ID: "x"}); err != nil {
		t.Fatalf("the same image again: %v", err)
	}
	// Delete sweeps blobs only x used; y's stay.
	if _, err := s.Put(other, tmplstore.Record{ID: "y"}); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete("x"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(s.BlobPath(rec.Digest)); !os.IsNotExist(err) {
		t.Fatalf("x's manifest after delete: %v", err)
	}
	od, _ := other.Digest()
	buf := make([]byte, 1<<20)
	if n, size, err := s.ReadBlob(od.String(), 0, buf); err != nil || int64(n) != size {
		t.Fatalf("y's manifest after x's delete: %d/%d %v", n, size, err)
	}
	if recs, err := s.List(); err != nil || len(recs) != 1 || recs[0].ID != "y" {
		t.Fatalf("list: %+v %v", recs, err)
	}
	if _, _, err := s.ReadBlob("sha256:../../etc", 0, buf); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("a malformed digest: %v", err)
	}

	// What a Put that died leaves is cleaned; records and blobs stay.
	left := []string{filepath.Join(s.Dir(), ".import-123", "oci"), filepath.Join(s.Dir(), "blobs", "sha256", ".blob-1"), filepath.Join(s.Dir(), "templates", ".rec-1")}
	for _, p := range left {
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Clean(); err != nil {
		t.Fatal(err)
	}
	for _, p := range left {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("%s after Clean: %v", p, err)
		}
	}
	if _, _, err := s.ReadBlob(od.String(), 0, buf); err != nil {
		t.Fatalf("y's manifest after Clean: %v", err)
	}
}
