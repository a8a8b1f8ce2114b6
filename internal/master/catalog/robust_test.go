package catalog_test

import (
	"database/sql"
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

// TestQuarantineUndecodable: a sandbox row whose network column is not
// JSON fails every query that reads it (the control: the list fails
// before Quarantine); Quarantine moves it, with its metadata, into the
// quarantine table, and the other rows are listed and served. A second
// pass finds nothing.
func TestQuarantineUndecodable(t *testing.T) {
	path := filepath.Join(t.TempDir(), "catalog.db")
	c, err := catalog.Open(ctx, catalog.SQLite, path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	now := time.Now().Truncate(time.Millisecond).UTC()
	for _, id := range []string{"good", "bad"} {
		if err := c.CreateSandbox(ctx, newSandbox(id, now, map[string]string{"who": id})); err != nil {
			t.Fatal(err)
		}
	}
	if q, err := c.Quarantine(ctx); err != nil || len(q) != 0 {
		t.Fatalf("clean catalog: quarantined %v %v", q, err)
	}
	if _, err := c.GetSandbox(ctx, "bad"); err != nil {
		t.Fatalf("control: the row before the damage: %v", err)
	}

	raw, err := sql.Open("sqlite", "file:"+path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := raw.Exec(`UPDATE sandboxes SET network = ? WHERE id = ?`, `{"allowOut":[`, "bad"); err != nil {
		t.Fatal(err)
	}
	raw.Close()
	if _, _, err := c.ListSandboxes(ctx, catalog.Query{}); err == nil {
		t.Fatal("control: a list with the damaged row succeeded; the test cannot show the quarantine is what fixes it")
	}

	q, err := c.Quarantine(ctx)
	if err != nil || len(q) != 1 || q[0].Table != "sandboxes" || q[0].Key != "bad" {
		t.Fatalf("quarantine: %+v %v", q, err)
	}
	t.Logf("quarantined %s/%s (%s): %s", q[0].Table, q[0].Key, q[0].Reason, q[0].Data)
	if !strings.Contains(q[0].Data, `"network":"{\"allowOut\":[`) || !strings.Contains(q[0].Data, `"who"`) {
		t.Fatalf("quarantined data lacks the row or its metadata: %s", q[0].Data)
	}
	list, _, err := c.ListSandboxes(ctx, catalog.Query{})
	if err != nil || len(list) != 1 || list[0].ID != "good" || list[0].Metadata["who"] != "good" {
		t.Fatalf("list after quarantine: %v %v", list, err)
	}
	if _, err := c.GetSandbox(ctx, "bad"); !errdefs.IsNotFound(err) {
		t.Fatalf("quarantined row still served: %v", err)
	}
	if again, err := c.Quarantine(ctx); err != nil || len(again) != 0 {
		t.Fatalf("second pass: %v %v", again, err)
	}
	if all, err := c.ListQuarantined(ctx); err != nil || len(all) != 1 || all[0].Key != "bad" {
		t.Fatalf("ListQuarantined: %v %v", all, err)
	}
}
