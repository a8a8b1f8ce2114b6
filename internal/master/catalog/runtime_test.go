package catalog_test

import (
	"database/sql"
	"path/filepath"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/master/catalog"
)

// testRuntime: a sandbox's and a snapshot's runtime survive the round trip
// and updates (migration 0003).
func testRuntime(t *testing.T, c *catalog.Catalog) {
	now := time.Now()
	s := newSandbox("rt-a", now, nil)
	s.Runtime = "gvisor"
	if err := c.CreateSandbox(ctx, s); err != nil {
		t.Fatal(err)
	}
	if got, err := c.GetSandbox(ctx, "rt-a"); err != nil || got.Runtime != "gvisor" {
		t.Fatalf("round trip: %+v %v", got, err)
	}
	if _, err := c.UpdateSandbox(ctx, "rt-a", func(s *catalog.Sandbox) error { s.Runtime = "vm"; return nil }); err != nil {
		t.Fatal(err)
	}
	if got, err := c.GetSandbox(ctx, "rt-a"); err != nil || got.Runtime != "vm" {
		t.Fatalf("after update: %+v %v", got, err)
	}
	if err := c.CreateSnapshot(ctx, &catalog.Snapshot{ID: "rt-snap", SandboxID: "rt-a", NodeID: "n1", TemplateID: "busybox", Runtime: "vm", CreatedAt: now}); err != nil {
		t.Fatal(err)
	}
	if got, err := c.GetSnapshot(ctx, "rt-snap"); err != nil || got.Runtime != "vm" {
		t.Fatalf("snapshot round trip: %+v %v", got, err)
	}
}

// TestRuntimeMigrationUpgrade takes a SQLite catalog back to schema 2 with
// a row in it and reopens it: 0003 applies and the old row reads with an
// empty (unknown) runtime.
func TestRuntimeMigrationUpgrade(t *testing.T) {
	path := filepath.Join(t.TempDir(), "catalog.db")
	c, err := catalog.Open(ctx, catalog.SQLite, path)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	db, err := sql.Open("sqlite", "file:"+path)
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range append(rollbackTeams,
		`ALTER TABLE sandboxes DROP COLUMN runtime`,
		`ALTER TABLE snapshots DROP COLUMN runtime`,
		`ALTER TABLE api_keys DROP COLUMN admin`, // 0004, applied again too
		`DELETE FROM schema_migrations WHERE version >= 3`,
		`INSERT INTO sandboxes (id, version, template_id, alias, node_id, state, milli_cpu, memory_mib, disk_mib, started_at, end_at,
auto_pause, auto_resume, envd_access_token, traffic_access_token, envd_version, network, api_key_id, idle_timeout_ms)
VALUES ('old', 1, 'busybox', '', 'n1', 'running', 1000, 512, 0, 1, 2, 0, 0, '', '', '', '', '', 0)`,
	) {
		if _, err := db.Exec(q); err != nil {
			db.Close()
			t.Fatalf("%s: %v", q, err)
		}
	}
	db.Close()
	c, err = catalog.Open(ctx, catalog.SQLite, path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if v, err := c.SchemaVersion(ctx); err != nil || v < 3 {
		t.Fatalf("schema version %d (%v), want at least 3", v, err)
	}
	got, err := c.GetSandbox(ctx, "old")
	if err != nil || got.Runtime != "" || got.TemplateID != "busybox" {
		t.Fatalf("old row: %+v %v", got, err)
	}
}

// TestAdminKeyColumn: a key's admin flag round-trips; keys are not admin
// unless created so.
func TestAdminKeyColumn(t *testing.T) {
	c, err := catalog.Open(ctx, catalog.SQLite, filepath.Join(t.TempDir(), "catalog.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for _, k := range []*catalog.APIKey{{ID: "key_a", Name: "plain", Prefix: "e2b_1", Hash: "h1"}, {ID: "key_b", Name: "ops", Prefix: "e2b_2", Hash: "h2", Admin: true}} {
		if err := c.CreateAPIKey(ctx, k); err != nil {
			t.Fatal(err)
		}
	}
	for hash, admin := range map[string]bool{"h1": false, "h2": true} {
		k, err := c.APIKeyByHash(ctx, hash)
		if err != nil || k.Admin != admin {
			t.Fatalf("key %s: %+v %v, want admin %v", hash, k, err, admin)
		}
	}
}
