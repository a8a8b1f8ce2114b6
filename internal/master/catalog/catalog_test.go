package catalog_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/catalog/catalogtest"
)

// backend is a database kind: setup runs once per backend (it may start a
// server, cleaned up with the backend's subtest) and returns how to get a
// fresh, empty database for each test.
type backend struct {
	name  string
	setup func(t *testing.T) func(t *testing.T) (driver, dsn string)
}

var backends = []backend{
	{"sqlite", func(*testing.T) func(*testing.T) (string, string) {
		return func(t *testing.T) (string, string) {
			return catalog.SQLite, filepath.Join(t.TempDir(), "catalog.db")
		}
	}},
	{"mariadb", func(t *testing.T) func(*testing.T) (string, string) {
		m := catalogtest.StartMariaDB(t)
		return func(t *testing.T) (string, string) { return catalog.MySQL, m.NewDatabase(t) }
	}},
}

// TestCatalog runs one suite against every backend.
func TestCatalog(t *testing.T) {
	suite := []struct {
		name string
		fn   func(t *testing.T, c *catalog.Catalog)
	}{
		{"Migrations", testMigrations},
		{"Nodes", testNodes},
		{"Sandboxes", testSandboxes},
		{"Paging", testPaging},
		{"ConcurrentUpdates", testConcurrentUpdates},
		{"Expired", testExpired},
		{"Tombstones", testTombstones},
		{"IdleTimeout", testIdleTimeout},
		{"Runtime", testRuntime},
		{"Snapshots", testSnapshots},
		{"APIKeys", testAPIKeys},
		{"Teams", testTeams},
		{"TeamDelete", testTeamDelete},
		{"Events", testEvents},
		{"Leases", testLeases},
		{"LeaseHeld", testLeaseHeld},
		{"Secrets", testSecrets},
		{"Volumes", testVolumes},
	}
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			fresh := b.setup(t)
			for _, tc := range suite {
				t.Run(tc.name, func(t *testing.T) {
					driver, dsn := fresh(t)
					c, err := catalog.Open(context.Background(), driver, dsn)
					if err != nil {
						t.Fatal(err)
					}
					defer c.Close()
					tc.fn(t, c)
				})
			}
			t.Run("Reopen", func(t *testing.T) {
				driver, dsn := fresh(t)
				testReopen(t, driver, dsn)
			})
		})
	}
}

var ctx = context.Background()

func testMigrations(t *testing.T, c *catalog.Catalog) {
	ms, err := catalog.Migrations()
	if err != nil || len(ms) == 0 {
		t.Fatalf("migrations: %v %d", err, len(ms))
	}
	v, err := c.SchemaVersion(ctx)
	if err != nil || v != len(ms) {
		t.Fatalf("schema version %d (%v), want %d", v, err, len(ms))
	}
}

// testReopen opens the same database twice: the second open applies
// nothing, and data written by the first is there.
func testReopen(t *testing.T, driver, dsn string) {
	c, err := catalog.Open(ctx, driver, dsn)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.CreateSandbox(ctx, &catalog.Sandbox{ID: "keep", TemplateID: "t", State: catalog.StateRunning, StartedAt: time.Now()}); err != nil {
		t.Fatal(err)
	}
	c.Close()
	c, err = catalog.Open(ctx, driver, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.GetSandbox(ctx, "keep"); err != nil {
		t.Fatal(err)
	}
}

func testNodes(t *testing.T, c *catalog.Catalog) {
	now := time.Now().Truncate(time.Millisecond).UTC()
	n := &catalog.Node{ID: "n1", Address: "unix:///a.sock", Report: []byte(`{"x":1}`), RegisteredAt: now, LastHeartbeat: now}
	tmpl := []catalog.NodeTemplate{{TemplateID: "busybox", Digest: "sha256:1", SizeBytes: 10, CreatedAt: now}}
	if err := c.PutNode(ctx, n, tmpl, true); err != nil {
		t.Fatal(err)
	}
	got, err := c.GetNode(ctx, "n1")
	if err != nil || !got.Schedulable || got.Address != n.Address || string(got.Report) != `{"x":1}` || !got.LastHeartbeat.Equal(now) {
		t.Fatalf("get: %+v %v", got, err)
	}
	if err := c.SetSchedulable(ctx, "n1", false); err != nil {
		t.Fatal(err)
	}
	// A heartbeat keeps the cordon and replaces the template set.
	later := now.Add(time.Second)
	n.LastHeartbeat = later
	tmpl = append(tmpl, catalog.NodeTemplate{TemplateID: "python", Digest: "sha256:2"})
	if err := c.PutNode(ctx, n, tmpl, false); err != nil {
		t.Fatal(err)
	}
	got, _ = c.GetNode(ctx, "n1")
	if got.Schedulable || !got.LastHeartbeat.Equal(later) || !got.RegisteredAt.Equal(now) {
		t.Fatalf("after heartbeat: %+v", got)
	}
	if err := c.PutNode(ctx, &catalog.Node{ID: "n2", Report: []byte("{}")}, []catalog.NodeTemplate{{TemplateID: "busybox"}}, true); err != nil {
		t.Fatal(err)
	}
	nts, err := c.ListNodeTemplates(ctx)
	if err != nil || len(nts) != 3 || nts[0].TemplateID != "busybox" || nts[0].NodeID != "n1" || nts[1].NodeID != "n2" || nts[2].TemplateID != "python" {
		t.Fatalf("node templates: %+v %v", nts, err)
	}
	nodes, _ := c.ListNodes(ctx)
	if len(nodes) != 2 {
		t.Fatalf("nodes: %d", len(nodes))
	}
	if err := c.DeleteNode(ctx, "n2"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.GetNode(ctx, "n2"); !errdefs.IsNotFound(err) {
		t.Fatalf("deleted node: %v", err)
	}
	if err := c.SetSchedulable(ctx, "ghost", true); !errdefs.IsNotFound(err) {
		t.Fatalf("cordon ghost: %v", err)
	}
}

func newSandbox(id string, started time.Time, md map[string]string) *catalog.Sandbox {
	return &catalog.Sandbox{
		ID: id, TemplateID: "busybox", NodeID: "n1", State: catalog.StateRunning, MilliCPU: 1000, MemoryMiB: 512,
		StartedAt: started, EndAt: started.Add(5 * time.Minute), Metadata: md,
	}
}

func testSandboxes(t *testing.T, c *catalog.Catalog) {
	now := time.Now().Truncate(time.Millisecond).UTC()
	f := false
	s := newSandbox("sb1", now, map[string]string{"user": "alice", "app": "prod", "with space": "ünïcode value"})
	s.Alias, s.AutoPause, s.EnvdAccessToken = "base", true, "tok"
	s.Network = catalog.Network{AllowInternet: &f, AllowOut: []string{"10.0.0.0/8"}}
	if err := c.CreateSandbox(ctx, s); err != nil {
		t.Fatal(err)
	}
	if err := c.CreateSandbox(ctx, newSandbox("sb1", now, nil)); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("duplicate: %v", err)
	}
	got, err := c.GetSandbox(ctx, "sb1")
	if err != nil {
		t.Fatal(err)
	}
	if got.Alias != "base" || !got.AutoPause || got.EnvdAccessToken != "tok" || got.Metadata["with space"] != "ünïcode value" ||
		len(got.Metadata) != 3 || got.Network.AllowInternet == nil || *got.Network.AllowInternet || got.Network.AllowOut[0] != "10.0.0.0/8" ||
		!got.StartedAt.Equal(now) || !got.EndAt.Equal(now.Add(5*time.Minute)) {
		t.Fatalf("round trip: %+v", got)
	}
	if err := c.CreateSandbox(ctx, newSandbox("sb2", now.Add(time.Second), map[string]string{"user": "bob", "app": "prod"})); err != nil {
		t.Fatal(err)
	}
	paused := newSandbox("sb3", now.Add(2*time.Second), map[string]string{"user": "alice"})
	paused.State = catalog.StatePaused
	if err := c.CreateSandbox(ctx, paused); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		q    catalog.Query
		want []string
	}{
		{catalog.Query{}, []string{"sb3", "sb2", "sb1"}},
		{catalog.Query{Ascending: true}, []string{"sb1", "sb2", "sb3"}},
		{catalog.Query{States: []string{catalog.StateRunning}}, []string{"sb2", "sb1"}},
		{catalog.Query{Metadata: map[string]string{"user": "alice"}}, []string{"sb3", "sb1"}},
		{catalog.Query{Metadata: map[string]string{"user": "alice", "app": "prod"}}, []string{"sb1"}},
		{catalog.Query{Metadata: map[string]string{"user": "carol"}}, nil},
		{catalog.Query{TemplateID: "base"}, []string{"sb1"}},
		{catalog.Query{StartedAfter: now.Add(time.Second)}, []string{"sb3", "sb2"}},
		{catalog.Query{States: []string{catalog.StatePaused}, Metadata: map[string]string{"user": "alice"}}, []string{"sb3"}},
	} {
		got, next, err := c.ListSandboxes(ctx, tc.q)
		if err != nil || next != "" {
			t.Fatalf("%+v: %v %q", tc.q, err, next)
		}
		if ids(got) != fmt.Sprint(tc.want) {
			t.Errorf("%+v: got %s want %v", tc.q, ids(got), tc.want)
		}
	}
	up, err := c.UpdateSandbox(ctx, "sb1", func(s *catalog.Sandbox) error {
		s.State = catalog.StatePaused
		return nil
	})
	if err != nil || up.State != catalog.StatePaused || up.Version != 2 {
		t.Fatalf("update: %+v %v", up, err)
	}
	if got, _ := c.GetSandbox(ctx, "sb1"); got.State != catalog.StatePaused || len(got.Metadata) != 3 {
		t.Fatalf("after update: %+v", got)
	}
	if _, err := c.UpdateSandbox(ctx, "sb1", func(*catalog.Sandbox) error { return errdefs.ErrFailedPrecondition }); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("aborted update: %v", err)
	}
	counts, _ := c.CountByNode(ctx)
	if counts["n1"] != 3 {
		t.Fatalf("count by node: %v", counts)
	}
	if err := c.DeleteSandbox(ctx, "sb1"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.GetSandbox(ctx, "sb1"); !errdefs.IsNotFound(err) {
		t.Fatalf("deleted: %v", err)
	}
	if err := c.DeleteSandbox(ctx, "sb1"); !errdefs.IsNotFound(err) {
		t.Fatalf("delete twice: %v", err)
	}
	// Metadata rows went with it: a new sandbox with the same ID starts clean.
	if err := c.CreateSandbox(ctx, newSandbox("sb1", now, nil)); err != nil {
		t.Fatal(err)
	}
	if got, _ := c.GetSandbox(ctx, "sb1"); len(got.Metadata) != 0 {
		t.Fatalf("stale metadata: %v", got.Metadata)
	}
}

func ids(sbs []*catalog.Sandbox) string {
	var out []string
	for _, s := range sbs {
		out = append(out, s.ID)
	}
	return fmt.Sprint(out)
}

func testPaging(t *testing.T, c *catalog.Catalog) {
	base := time.Now().Truncate(time.Millisecond)
	// Pairs share a start time, so the cursor's ID tie-break is exercised.
	for i := range 25 {
		if err := c.CreateSandbox(ctx, newSandbox(fmt.Sprintf("p%02d", i), base.Add(time.Duration(i/2)*time.Second), nil)); err != nil {
			t.Fatal(err)
		}
	}
	for _, asc := range []bool{false, true} {
		seen := map[string]bool{}
		var order []string
		tok, pages := "", 0
		for {
			page, next, err := c.ListSandboxes(ctx, catalog.Query{Limit: 7, After: tok, Ascending: asc})
			if err != nil {
				t.Fatal(err)
			}
			pages++
			for _, s := range page {
				if seen[s.ID] {
					t.Fatalf("%s seen twice", s.ID)
				}
				seen[s.ID] = true
				order = append(order, s.ID)
			}
			if next == "" {
				break
			}
			tok = next
		}
		if len(seen) != 25 || pages != 4 {
			t.Fatalf("asc=%v: %d sandboxes in %d pages", asc, len(seen), pages)
		}
		if asc && (order[0] != "p00" || order[24] != "p24") || !asc && (order[0] != "p24" || order[24] != "p00") {
			t.Fatalf("asc=%v order: %v", asc, order)
		}
	}
	if _, _, err := c.ListSandboxes(ctx, catalog.Query{After: "!!garbage"}); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("bad token: %v", err)
	}
}

// testConcurrentUpdates: 8 writers each add 1 to the same counter 10 times;
// optimistic concurrency must lose none of the 80 increments.
func testConcurrentUpdates(t *testing.T, c *catalog.Catalog) {
	if err := c.CreateSandbox(ctx, newSandbox("race", time.Now(), nil)); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 10 {
				for {
					_, err := c.UpdateSandbox(ctx, "race", func(s *catalog.Sandbox) error { s.DiskMiB++; return nil })
					if err == nil {
						break
					}
					if !errors.Is(err, catalog.ErrConflict) {
						t.Error(err)
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	got, _ := c.GetSandbox(ctx, "race")
	if got.DiskMiB != 80 {
		t.Fatalf("lost updates: counter %d, want 80", got.DiskMiB)
	}
}

func testExpired(t *testing.T, c *catalog.Catalog) {
	now := time.Now()
	for i, d := range []time.Duration{-time.Minute, -time.Second, time.Minute} {
		s := newSandbox(fmt.Sprintf("e%d", i), now, nil)
		s.EndAt = now.Add(d)
		if err := c.CreateSandbox(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	p := newSandbox("paused", now, nil)
	p.State, p.EndAt = catalog.StatePaused, now.Add(-time.Hour)
	if err := c.CreateSandbox(ctx, p); err != nil {
		t.Fatal(err)
	}
	got, err := c.Expired(ctx, now, 10)
	if err != nil || ids(got) != "[e0 e1]" {
		t.Fatalf("expired: %s %v", ids(got), err)
	}
	if got, _ := c.Expired(ctx, now, 1); ids(got) != "[e0]" {
		t.Fatalf("limit: %s", ids(got))
	}
	// Per node: expiry works on each node's deadlines on its own.
	o := newSandbox("other", now, nil)
	o.NodeID, o.EndAt = "n-other", now.Add(-time.Second)
	if err := c.CreateSandbox(ctx, o); err != nil {
		t.Fatal(err)
	}
	nodes, err := c.ExpiredNodes(ctx, now)
	if err != nil || fmt.Sprint(nodes) != "[n-other n1]" {
		t.Fatalf("expired nodes: %v %v", nodes, err)
	}
	if got, err := c.ExpiredOn(ctx, "n-other", now, 10); err != nil || ids(got) != "[other]" {
		t.Fatalf("expired on n-other: %s %v", ids(got), err)
	}
	if got, err := c.ExpiredOn(ctx, "n1", now, 10); err != nil || ids(got) != "[e0 e1]" {
		t.Fatalf("expired on n1: %s %v", ids(got), err)
	}
}

func testTombstones(t *testing.T, c *catalog.Catalog) {
	now := time.Now()
	for _, id := range []string{"gone", "kept"} {
		if err := c.CreateSandbox(ctx, newSandbox(id, now, nil)); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.DeleteSandbox(ctx, "gone"); err != nil {
		t.Fatal(err)
	}
	for id, want := range map[string]bool{"gone": true, "kept": false, "never": false} {
		if got, err := c.Tombstoned(ctx, id); err != nil || got != want {
			t.Fatalf("Tombstoned(%s) = %v, %v; want %v", id, got, err, want)
		}
	}
	// The same ID removed again (a row re-created by reconcile's adoption,
	// then killed) keeps one tombstone.
	if err := c.CreateSandbox(ctx, newSandbox("gone", now, nil)); err != nil {
		t.Fatal(err)
	}
	if err := c.DeleteSandbox(ctx, "gone"); err != nil {
		t.Fatal(err)
	}
	if n, err := c.PruneTombstones(ctx, now.Add(-time.Minute)); err != nil || n != 0 {
		t.Fatalf("prune of older ones: %d %v", n, err)
	}
	if n, err := c.PruneTombstones(ctx, time.Now().Add(time.Second)); err != nil || n != 1 {
		t.Fatalf("prune: %d %v, want 1", n, err)
	}
	if got, _ := c.Tombstoned(ctx, "gone"); got {
		t.Fatal("tombstone outlived its pruning")
	}
}

func testSnapshots(t *testing.T, c *catalog.Catalog) {
	now := time.Now().Truncate(time.Millisecond)
	for i, s := range []*catalog.Snapshot{
		{ID: "snap-a", Name: "golden", SandboxID: "sb1", NodeID: "n1", TemplateID: "busybox", HasMemory: true, CreatedAt: now},
		{ID: "snap-b", SandboxID: "sb1", NodeID: "n1", TemplateID: "busybox", CreatedAt: now.Add(time.Second)},
		{ID: "snap-c", Name: "golden", SandboxID: "sb2", NodeID: "n2", TemplateID: "busybox", CreatedAt: now.Add(2 * time.Second)},
	} {
		if err := c.CreateSnapshot(ctx, s); err != nil {
			t.Fatal(i, err)
		}
	}
	if err := c.CreateSnapshot(ctx, &catalog.Snapshot{ID: "snap-a"}); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("duplicate: %v", err)
	}
	if s, err := c.GetSnapshot(ctx, "snap-a"); err != nil || !s.HasMemory || s.Name != "golden" {
		t.Fatalf("by id: %+v %v", s, err)
	}
	if s, err := c.GetSnapshot(ctx, "golden"); err != nil || s.ID != "snap-c" {
		t.Fatalf("by name gives the newest: %+v %v", s, err)
	}
	if _, err := c.GetSnapshot(ctx, "nope"); !errdefs.IsNotFound(err) {
		t.Fatalf("missing: %v", err)
	}
	page, next, err := c.ListSnapshots(ctx, catalog.SnapshotQuery{SandboxID: "sb1", Limit: 1})
	if err != nil || len(page) != 1 || page[0].ID != "snap-a" || next != "snap-a" {
		t.Fatalf("page 1: %+v %q %v", page, next, err)
	}
	page, next, _ = c.ListSnapshots(ctx, catalog.SnapshotQuery{SandboxID: "sb1", Limit: 1, After: next})
	if len(page) != 1 || page[0].ID != "snap-b" || next != "" {
		t.Fatalf("page 2: %+v %q", page, next)
	}
	if page, _, _ := c.ListSnapshots(ctx, catalog.SnapshotQuery{Name: "golden"}); len(page) != 2 {
		t.Fatalf("by name: %d", len(page))
	}
	if err := c.DeleteSnapshot(ctx, "snap-a"); err != nil {
		t.Fatal(err)
	}
	if err := c.DeleteSnapshot(ctx, "snap-a"); !errdefs.IsNotFound(err) {
		t.Fatalf("delete twice: %v", err)
	}
}

func testAPIKeys(t *testing.T, c *catalog.Catalog) {
	now := time.Now().Truncate(time.Millisecond)
	k := &catalog.APIKey{ID: "k1", Name: "ci", Prefix: "e2b_ab12", Hash: fmt.Sprintf("%064x", 1), CreatedAt: now}
	if err := c.CreateAPIKey(ctx, k); err != nil {
		t.Fatal(err)
	}
	if err := c.CreateAPIKey(ctx, &catalog.APIKey{ID: "k2", Name: "ci", Hash: fmt.Sprintf("%064x", 2)}); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("duplicate name: %v", err)
	}
	got, err := c.APIKeyByHash(ctx, k.Hash)
	if err != nil || got.ID != "k1" || got.Prefix != "e2b_ab12" {
		t.Fatalf("by hash: %+v %v", got, err)
	}
	if _, err := c.APIKeyByHash(ctx, fmt.Sprintf("%064x", 9)); !errdefs.IsNotFound(err) {
		t.Fatalf("unknown hash: %v", err)
	}
	if err := c.TouchAPIKey(ctx, "k1", now.Add(time.Minute)); err != nil {
		t.Fatal(err)
	}
	keys, _ := c.ListAPIKeys(ctx)
	if len(keys) != 1 || !keys[0].LastUsedAt.Equal(now.Add(time.Minute)) {
		t.Fatalf("list: %+v", keys)
	}
	if del, err := c.DeleteAPIKey(ctx, "ci"); err != nil || del.ID != "k1" {
		t.Fatalf("delete by name: %+v %v", del, err)
	}
	if _, err := c.DeleteAPIKey(ctx, "k1"); !errdefs.IsNotFound(err) {
		t.Fatalf("delete twice: %v", err)
	}
}

func testEvents(t *testing.T, c *catalog.Catalog) {
	at := time.Now()
	// Same instant three times: the clock still orders them.
	for _, msg := range []string{"created", "paused", "resumed"} {
		if err := c.AddEvent(ctx, catalog.Event{SandboxID: "ev", At: at, Message: msg, Fields: map[string]string{"node": "n1"}}); err != nil {
			t.Fatal(err)
		}
	}
	evs, err := c.ListEvents(ctx, catalog.EventQuery{SandboxID: "ev"})
	if err != nil || len(evs) != 3 || evs[0].Message != "created" || evs[2].Message != "resumed" || evs[1].Fields["node"] != "n1" {
		t.Fatalf("forward: %+v %v", evs, err)
	}
	evs, _ = c.ListEvents(ctx, catalog.EventQuery{SandboxID: "ev", Backward: true, Limit: 2})
	if len(evs) != 2 || evs[0].Message != "resumed" {
		t.Fatalf("backward: %+v", evs)
	}
	evs, _ = c.ListEvents(ctx, catalog.EventQuery{SandboxID: "ev", Since: at.Add(time.Hour)})
	if len(evs) != 0 {
		t.Fatalf("since the future: %+v", evs)
	}
}
