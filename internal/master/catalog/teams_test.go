package catalog_test

import (
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// rollbackTeams undoes migrations 0014 to 0005 on SQLite, the way the
// migration tests take a catalog back to an older schema.
var rollbackTeams = []string{
	`ALTER TABLE sandbox_activity DROP COLUMN quiesce_token`, // 0014
	`DROP TABLE volumes`, // 0013
	`ALTER TABLE sandboxes DROP COLUMN pause_snapshot`, // 0012
	`DROP TABLE secrets`,           // 0011
	`DROP TABLE cluster_templates`, // 0010
	`DROP TABLE join_tokens`,       // 0009
	`DROP TABLE leases`,            // 0008
	`DROP TABLE route_events`,
	`DROP TABLE sandbox_activity`,
	`DROP TABLE quarantine`,         // 0007
	`DROP TABLE sandbox_tombstones`, // 0006
	`DROP INDEX sandboxes_team`,
	`DROP INDEX snapshots_team_name`,
	`ALTER TABLE sandboxes DROP COLUMN team`,
	`ALTER TABLE snapshots DROP COLUMN team`,
	`ALTER TABLE api_keys DROP COLUMN team`,
	`DROP TABLE teams`,
	`DELETE FROM schema_migrations WHERE version >= 5`,
}

// TestTeamsMigrationUpgrade takes a SQLite catalog back to schema 4 with a
// key, a sandbox and a snapshot in it and reopens it: 0005 applies, the
// team "default" exists without limits, and the old rows belong to it. A
// second rollback and upgrade of the same file applies cleanly (the
// rollback undoes all of 0005).
func TestTeamsMigrationUpgrade(t *testing.T) {
	path := filepath.Join(t.TempDir(), "catalog.db")
	c, err := catalog.Open(ctx, catalog.SQLite, path)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	for round := range 2 {
		db, err := sql.Open("sqlite", "file:"+path)
		if err != nil {
			t.Fatal(err)
		}
		for _, q := range append(rollbackTeams,
			`DELETE FROM api_keys`, `DELETE FROM sandboxes`, `DELETE FROM snapshots`,
			`INSERT INTO api_keys (id, name, prefix, hash, created_at, last_used_at, admin) VALUES ('key_old', 'cube-up', 'e2b_12', 'h-old', 1, 0, 0)`,
			`INSERT INTO sandboxes (id, version, template_id, alias, node_id, state, milli_cpu, memory_mib, disk_mib, started_at, end_at,
auto_pause, auto_resume, envd_access_token, traffic_access_token, envd_version, network, api_key_id, idle_timeout_ms, runtime)
VALUES ('old', 1, 'busybox', '', 'n1', 'running', 1000, 512, 0, 1, 2, 0, 0, '', '', '', '', 'key_old', 0, 'runc')`,
			`INSERT INTO snapshots (id, name, sandbox_id, node_id, template_id, has_memory, envd_access_token, created_at, runtime)
VALUES ('snap-old', 'golden', 'old', 'n1', 'busybox', 0, '', 1, 'runc')`,
		) {
			if _, err := db.Exec(q); err != nil {
				db.Close()
				t.Fatalf("round %d: %s: %v", round, q, err)
			}
		}
		db.Close()
		c, err = catalog.Open(ctx, catalog.SQLite, path)
		if err != nil {
			t.Fatalf("round %d: upgrade: %v", round, err)
		}
		if v, err := c.SchemaVersion(ctx); err != nil || v < 5 {
			t.Fatalf("schema version %d (%v), want at least 5", v, err)
		}
		team, err := c.GetTeam(ctx, catalog.DefaultTeam)
		if err != nil || team.Quota != (catalog.Quota{}) {
			t.Fatalf("default team: %+v %v", team, err)
		}
		k, err := c.APIKeyByHash(ctx, "h-old")
		if err != nil || k.Team != catalog.DefaultTeam {
			t.Fatalf("old key: %+v %v", k, err)
		}
		sb, err := c.GetSandbox(ctx, "old")
		if err != nil || sb.Team != catalog.DefaultTeam {
			t.Fatalf("old sandbox: %+v %v", sb, err)
		}
		if s, err := c.GetTeamSnapshot(ctx, catalog.DefaultTeam, "golden"); err != nil || s.ID != "snap-old" {
			t.Fatalf("old snapshot by name in the default team: %+v %v", s, err)
		}
		if _, err := c.GetTeamSnapshot(ctx, "other", "golden"); !errdefs.IsNotFound(err) {
			t.Fatalf("old snapshot from another team: %v", err)
		}
		c.Close()
	}
}

// testTeams (every backend): teams and keys, scoped lookups and listings,
// and quotas that hold under concurrent creates.
func testTeams(t *testing.T, c *catalog.Catalog) {
	now := time.Now()
	if err := c.CreateTeam(ctx, &catalog.Team{Name: "a", CreatedAt: now, Quota: catalog.Quota{MaxSandboxes: 3}}); err != nil {
		t.Fatal(err)
	}
	if err := c.CreateTeam(ctx, &catalog.Team{Name: "a", CreatedAt: now}); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("duplicate team: %v", err)
	}
	if err := c.CreateTeam(ctx, &catalog.Team{Name: "b", CreatedAt: now}); err != nil {
		t.Fatal(err)
	}
	if err := c.CreateAPIKey(ctx, &catalog.APIKey{ID: "key_x", Name: "x", Prefix: "e2b_x", Hash: "hx", Team: "nosuch"}); !errdefs.IsNotFound(err) {
		t.Fatalf("key of an unknown team: %v", err)
	}
	if err := c.CreateAPIKey(ctx, &catalog.APIKey{ID: "key_a", Name: "a1", Prefix: "e2b_a", Hash: "ha", Team: "a"}); err != nil {
		t.Fatal(err)
	}
	if k, err := c.APIKeyByHash(ctx, "ha"); err != nil || k.Team != "a" {
		t.Fatalf("key team: %+v %v", k, err)
	}

	// Quota: 20 concurrent creates for team a (max 3) and, as the
	// control, 20 for team b (no limit).
	const n = 20
	var wg sync.WaitGroup
	errs := map[string][]error{"a": make([]error, n), "b": make([]error, n)}
	for team, out := range errs {
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				s := newSandbox(fmt.Sprintf("%s-%d", team, i), now, nil)
				s.Team = team
				out[i] = c.CreateSandbox(ctx, s)
			}()
		}
	}
	wg.Wait()
	for team, out := range errs {
		ok, over := 0, 0
		for _, err := range out {
			var qe *catalog.QuotaError
			switch {
			case err == nil:
				ok++
			case errors.As(err, &qe) && errdefs.IsResourceExhausted(err):
				over++
			default:
				t.Fatalf("team %s create: %v", team, err)
			}
		}
		t.Logf("team %s: %d concurrent creates: %d written, %d over quota", team, n, ok, over)
		if want := map[string]int{"a": 3, "b": n}[team]; ok != want {
			t.Errorf("team %s: %d written, want %d", team, ok, want)
		}
	}
	teams, usage, err := c.ListTeams(ctx)
	if err != nil || len(teams) != 3 || usage["a"].Sandboxes != 3 || usage["b"].Sandboxes != n || usage["a"].MilliCPU != 3*1000 {
		t.Fatalf("list teams: %d %+v %v", len(teams), usage, err)
	}
	// Raising the quota lets one more in.
	if err := c.SetTeamQuota(ctx, "a", catalog.Quota{MaxSandboxes: 4}); err != nil {
		t.Fatal(err)
	}
	s := newSandbox("a-more", now, nil)
	s.Team = "a"
	if err := c.CreateSandbox(ctx, s); err != nil {
		t.Fatalf("create under the raised quota: %v", err)
	}
	if err := c.SetTeamQuota(ctx, "nosuch", catalog.Quota{}); !errdefs.IsNotFound(err) {
		t.Fatalf("quota of an unknown team: %v", err)
	}
	if got, _, err := c.ListSandboxes(ctx, catalog.Query{Team: "a"}); err != nil || len(got) != 4 {
		t.Fatalf("team a lists %d (%v)", len(got), err)
	}

	// Snapshots: names resolve within the team.
	for _, sn := range []*catalog.Snapshot{
		{ID: "snap-a", Name: "golden", SandboxID: "a-more", NodeID: "n1", TemplateID: "busybox", CreatedAt: now, Team: "a"},
		{ID: "snap-b", Name: "golden", SandboxID: "b-0", NodeID: "n1", TemplateID: "busybox", CreatedAt: now.Add(time.Second), Team: "b"},
	} {
		if err := c.CreateSnapshot(ctx, sn); err != nil {
			t.Fatal(err)
		}
	}
	for team, want := range map[string]string{"a": "snap-a", "b": "snap-b", "": "snap-b"} {
		if s, err := c.GetTeamSnapshot(ctx, team, "golden"); err != nil || s.ID != want {
			t.Errorf("team %q golden: %+v %v, want %s", team, s, err, want)
		}
	}
	if _, err := c.GetTeamSnapshot(ctx, "b", "snap-a"); !errdefs.IsNotFound(err) {
		t.Errorf("team b finds team a's snapshot by ID: %v", err)
	}
	if got, _, err := c.ListSnapshots(ctx, catalog.SnapshotQuery{Team: "a"}); err != nil || len(got) != 1 || got[0].ID != "snap-a" {
		t.Errorf("team a's snapshots: %v %v", got, err)
	}
}

// testTeamDelete: a team holding a sandbox, then only a snapshot, is not
// deleted (TeamInUseError, FailedPrecondition) and keeps its key; with
// neither, the team and its keys go and another team's key stays; a
// create for a deleted team with a quota is refused (NotFound).
func testTeamDelete(t *testing.T, c *catalog.Catalog) {
	now := time.Now()
	for _, team := range []string{"t", "q"} {
		if err := c.CreateTeam(ctx, &catalog.Team{Name: team, CreatedAt: now, Quota: catalog.Quota{MaxSandboxes: map[string]int64{"t": 0, "q": 5}[team]}}); err != nil {
			t.Fatal(err)
		}
	}
	for _, k := range []*catalog.APIKey{{ID: "key_t", Name: "t1", Prefix: "e2b_t", Hash: "ht", Team: "t"}, {ID: "key_d", Name: "d1", Prefix: "e2b_d", Hash: "hd"}} {
		if err := c.CreateAPIKey(ctx, k); err != nil {
			t.Fatal(err)
		}
	}
	sb := newSandbox("sb-t", now, nil)
	sb.Team = "t"
	if err := c.CreateSandbox(ctx, sb); err != nil {
		t.Fatal(err)
	}
	refused := func(what string) {
		t.Helper()
		_, err := c.DeleteTeam(ctx, "t")
		var inUse *catalog.TeamInUseError
		if !errors.As(err, &inUse) || !errdefs.IsFailedPrecondition(err) {
			t.Fatalf("delete a team holding %s: %v, want TeamInUseError", what, err)
		}
		if _, err := c.GetTeam(ctx, "t"); err != nil {
			t.Fatalf("the team after a refused delete: %v", err)
		}
		if _, err := c.APIKeyByHash(ctx, "ht"); err != nil {
			t.Fatalf("the team's key after a refused delete: %v", err)
		}
		t.Logf("holding %s: %v", what, err)
	}
	refused("a sandbox")
	if err := c.DeleteSandbox(ctx, "sb-t"); err != nil {
		t.Fatal(err)
	}
	if err := c.CreateSnapshot(ctx, &catalog.Snapshot{ID: "snap-t", SandboxID: "sb-t", NodeID: "n1", TemplateID: "busybox", CreatedAt: now, Team: "t"}); err != nil {
		t.Fatal(err)
	}
	refused("a snapshot")
	if err := c.DeleteSnapshot(ctx, "snap-t"); err != nil {
		t.Fatal(err)
	}
	keys, err := c.DeleteTeam(ctx, "t")
	if err != nil || len(keys) != 1 || keys[0].ID != "key_t" {
		t.Fatalf("delete an empty team: %v %v, want its one key", keys, err)
	}
	if _, err := c.APIKeyByHash(ctx, "ht"); !errdefs.IsNotFound(err) {
		t.Fatalf("the deleted team's key: %v, want NotFound", err)
	}
	if _, err := c.GetTeam(ctx, "t"); !errdefs.IsNotFound(err) {
		t.Fatalf("the deleted team: %v", err)
	}
	if _, err := c.APIKeyByHash(ctx, "hd"); err != nil {
		t.Fatalf("another team's key after the delete: %v", err)
	}
	if _, err := c.DeleteTeam(ctx, "t"); !errdefs.IsNotFound(err) {
		t.Fatalf("delete twice: %v", err)
	}
	if _, err := c.DeleteTeam(ctx, "q"); err != nil {
		t.Fatal(err)
	}
	sq := newSandbox("sb-q", now, nil)
	sq.Team = "q"
	if err := c.CreateSandbox(ctx, sq); !errdefs.IsNotFound(err) {
		t.Fatalf("a create for a deleted team with a quota: %v, want NotFound", err)
	}
}
