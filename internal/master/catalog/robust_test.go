package catalog_test

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/nospace/nospacetest"
)

// TestSQLiteNoSpace: with the catalog's filesystem full, an insert (in a
// transaction, with its metadata) and an update fail whole with
// ErrNoSpace naming the filesystem; the rows read as before; and the same
// writes succeed on the same open catalog once space returns.
func TestSQLiteNoSpace(t *testing.T) {
	mnt := nospacetest.Mount(t, "ext4", 64)
	c, err := catalog.Open(ctx, catalog.SQLite, filepath.Join(mnt, "catalog.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	now := time.Now().Truncate(time.Millisecond).UTC()
	if err := c.CreateSandbox(ctx, newSandbox("sb1", now, map[string]string{"v": "1"})); err != nil {
		t.Fatal(err)
	}
	free := nospacetest.Fill(t, mnt)

	// Enough metadata that the write needs pages the file does not have.
	big := map[string]string{}
	for i := range 500 {
		big[fmt.Sprintf("k%04d", i)] = strings.Repeat("v", 1000)
	}
	err = c.CreateSandbox(ctx, newSandbox("sb2", now, big))
	t.Logf("insert on a full disk: %v", err)
	if !errdefs.IsNoSpace(err) || !strings.Contains(err.Error(), mnt) {
		t.Fatalf("insert on a full disk: %v, want ErrNoSpace naming %s", err, mnt)
	}
	if _, err := c.GetSandbox(ctx, "sb2"); !errdefs.IsNotFound(err) {
		t.Fatalf("failed insert left a row: %v", err)
	}
	_, err = c.UpdateSandbox(ctx, "sb1", func(s *catalog.Sandbox) error {
		s.State = catalog.StatePaused
		s.Alias = strings.Repeat("a", 1<<20)
		return nil
	})
	t.Logf("update on a full disk: %v", err)
	if !errdefs.IsNoSpace(err) {
		t.Fatalf("update on a full disk: %v, want ErrNoSpace", err)
	}
	if got, err := c.GetSandbox(ctx, "sb1"); err != nil || got.State != catalog.StateRunning || got.Metadata["v"] != "1" {
		t.Fatalf("after failed writes: %+v %v", got, err)
	}

	free()
	if err := c.CreateSandbox(ctx, newSandbox("sb2", now, big)); err != nil {
		t.Fatalf("insert after freeing space: %v", err)
	}
	if got, err := c.GetSandbox(ctx, "sb2"); err != nil || len(got.Metadata) != len(big) {
		t.Fatalf("row after recovery: %v", err)
	}
	if _, err := c.UpdateSandbox(ctx, "sb1", func(s *catalog.Sandbox) error { s.State = catalog.StatePaused; return nil }); err != nil {
		t.Fatalf("update after freeing space: %v", err)
	}
}
