package catalog_test

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/cubesandbox/cube/internal/master/catalog"
)

// TestSQLiteDurability: the catalog commits with the WAL fsynced
// (journal_mode=WAL, synchronous=FULL), so a write the master acknowledged
// survives a crash of the machine; NORMAL would let the last commits go.
// Checked on a fresh database and after reopening it (the pragmas are
// per connection, set by the DSN on every open).
func TestSQLiteDurability(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "catalog.db")
	for _, round := range []string{"fresh", "reopened"} {
		c, err := catalog.Open(ctx, catalog.SQLite, path)
		if err != nil {
			t.Fatal(err)
		}
		journal, sync, err := c.Durability(ctx)
		c.Close()
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: journal_mode=%s synchronous=%d", round, journal, sync)
		if journal != "wal" || sync != 2 {
			t.Fatalf("%s: journal_mode=%q synchronous=%d, want wal and 2 (FULL)", round, journal, sync)
		}
	}
}
