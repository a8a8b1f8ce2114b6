package catalog_test

import (
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// TestClusterTemplates: a record reads back as written; the same ID with
// the same image again is accepted, with another image refused; delete
// removes it and a second delete is not an error.
func TestClusterTemplates(t *testing.T) {
	c, err := catalog.Open(ctx, catalog.SQLite, filepath.Join(t.TempDir(), "catalog.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	rec := &catalog.ClusterTemplate{ID: "py", Digest: "sha256:aa", BlobBytes: 42, Source: "/src", Runtime: "runc", Warm: true,
		Object: "py.aa", Replica: "a", CreatedAt: time.UnixMilli(1700000000123).UTC()}
	if err := c.PutClusterTemplate(ctx, rec); err != nil {
		t.Fatal(err)
	}
	got, err := c.GetClusterTemplate(ctx, "py")
	if err != nil || *got != *rec {
		t.Fatalf("read back %+v %v, want %+v", got, err, rec)
	}
	if err := c.PutClusterTemplate(ctx, rec); err != nil {
		t.Fatalf("same record again: %v", err)
	}
	other := *rec
	other.Digest = "sha256:bb"
	if err := c.PutClusterTemplate(ctx, &other); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("another image under the same ID: %v, want AlreadyExists", err)
	}
	if list, err := c.ListClusterTemplates(ctx); err != nil || len(list) != 1 {
		t.Fatalf("list: %v %v", list, err)
	}
	for range 2 {
		if err := c.DeleteClusterTemplate(ctx, "py"); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.GetClusterTemplate(ctx, "py"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("after delete: %v", err)
	}
}
