package catalog

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// openSQLite opens a fresh SQLite catalog in a temporary directory.
func openSQLite(t *testing.T) *Catalog {
	t.Helper()
	c, err := Open(context.Background(), SQLite, filepath.Join(t.TempDir(), "catalog.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// holdCommitter occupies the committer with a write that waits until the
// returned release is called, so the writes made meanwhile queue up.
func holdCommitter(t *testing.T, c *Catalog) (release func() error) {
	t.Helper()
	started, unblock := make(chan struct{}), make(chan struct{})
	errc := make(chan error, 1)
	go func() {
		errc <- c.tx(context.Background(), func(tx *sql.Tx) error {
			close(started)
			<-unblock
			_, err := tx.Exec(`INSERT INTO route_events (id, sandbox_id, at_ms) VALUES ('hold', 'x', 1)`)
			return err
		})
	}()
	<-started
	return func() error { close(unblock); return <-errc }
}

// waitQueued waits until n writes wait for the committer.
func waitQueued(t *testing.T, c *Catalog, n int64) {
	t.Helper()
	waitFor(t, c, func(q int64) bool { return q >= n }, fmt.Sprintf("at least %d", n))
}

func waitFor(t *testing.T, c *Catalog, ok func(queued int64) bool, want string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !ok(c.gc.waiting.Load()) {
		if time.Now().After(deadline) {
			t.Fatalf("%d writes queued, want %s", c.gc.waiting.Load(), want)
		}
		time.Sleep(time.Millisecond)
	}
	// Counted a moment before it blocks on the hand-over: give the last
	// one that moment.
	time.Sleep(20 * time.Millisecond)
}

func countRows(t *testing.T, c *Catalog, where string) int {
	t.Helper()
	var n int
	if err := c.db.QueryRow(`SELECT COUNT(*) FROM route_events WHERE ` + where).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestGroupCommit: writes that queue while the committer is busy commit
// together, in one transaction (one WAL fsync), and each gets its own
// answer: a write that fails is undone alone (its first statement did
// run), a write that panics panics in its caller, a write whose caller
// gave up while queued is not made, and every other write is committed.
// A write alone is a plain transaction.
func TestGroupCommit(t *testing.T) {
	c := openSQLite(t)
	ctx := context.Background()
	if _, err := c.exec(ctx, `INSERT INTO route_events (id, sandbox_id, at_ms) VALUES ('alone', 'x', 1)`); err != nil {
		t.Fatal(err)
	}
	commits0, writes0 := c.GroupCommits()
	if commits0 == 0 || writes0 != commits0 {
		t.Fatalf("lone writes: %d commits for %d writes, want one each", commits0, writes0)
	}

	release := holdCommitter(t, c)
	const n = 20
	errs := make([]error, n)
	panics := make([]any, n)
	gone, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			defer func() { panics[i] = recover() }()
			wctx := ctx
			if i == 7 {
				wctx = gone
			}
			errs[i] = c.tx(wctx, func(tx *sql.Tx) error {
				if _, err := tx.ExecContext(wctx, `INSERT INTO route_events (id, sandbox_id, at_ms) VALUES (?, 'g', 1)`, fmt.Sprint("w", i)); err != nil {
					return err
				}
				switch i {
				case 3: // fails after its first statement ran
					return errors.New("write 3 refuses")
				case 5: // a second statement that breaks a unique key
					_, err := tx.ExecContext(wctx, `INSERT INTO route_events (id, sandbox_id, at_ms) VALUES ('alone', 'g', 1)`)
					return err
				case 9:
					panic("write 9 panics")
				}
				return nil
			})
		})
	}
	waitQueued(t, c, n)
	cancel() // write 7's caller gives up while it waits
	waitFor(t, c, func(q int64) bool { return q == n-1 }, fmt.Sprint(n-1))
	if err := release(); err != nil {
		t.Fatal(err)
	}
	wg.Wait()

	for i := range n {
		switch i {
		case 3:
			if errs[i] == nil || errs[i].Error() != "write 3 refuses" {
				t.Errorf("write 3: %v", errs[i])
			}
		case 5:
			if !isDuplicate(errs[i]) {
				t.Errorf("write 5: %v, want a unique-key violation", errs[i])
			}
		case 7:
			if !errors.Is(errs[i], context.Canceled) {
				t.Errorf("write 7: %v, want its caller's cancel", errs[i])
			}
		case 9:
			if panics[i] != "write 9 panics" {
				t.Errorf("write 9: panic %v, error %v; want its panic re-raised", panics[i], errs[i])
			}
		default:
			if errs[i] != nil || panics[i] != nil {
				t.Errorf("write %d: %v %v", i, errs[i], panics[i])
			}
		}
	}
	for _, id := range []string{"w3", "w5", "w7", "w9"} {
		if got := countRows(t, c, "id = '"+id+"'"); got != 0 {
			t.Errorf("%s: the failed write's first statement is still there", id)
		}
	}
	if got := countRows(t, c, "sandbox_id = 'g'"); got != n-4 {
		t.Errorf("%d rows committed, want %d", got, n-4)
	}
	commits, writes := c.GroupCommits()
	t.Logf("%d writes queued behind a busy committer: %d commits for %d writes", n, commits-commits0, writes-writes0)
	// The held write's own commit, then one for the whole queue (a
	// writer the scheduler kept from its hand-over for the whole wait
	// may come in a group of its own: at most a few groups).
	if writes-writes0 != 1+n-4 || commits-commits0 > 4 {
		t.Fatalf("%d commits for %d writes; want 2 commits (the held write, then the group), at most 4, for %d", commits-commits0, writes-writes0, 1+n-4)
	}
}

// TestGroupCommitBrokenGroup: when SQLite rolls a group's transaction
// back under it (a full disk, an I/O error, an interrupted statement do),
// the writes that had run in it are gone with it; the committer runs each
// of them again on its own, so they are committed all the same, and only
// the write that broke it fails. A write that ends the transaction itself
// stands in for SQLite here: one that says so (returns an error), and one
// that swallows it (returns nil), whose caller must not hear success for
// a write the database does not hold.
func TestGroupCommitBrokenGroup(t *testing.T) {
	for _, swallow := range []bool{false, true} {
		t.Run(fmt.Sprintf("swallowed=%v", swallow), func(t *testing.T) {
			c := openSQLite(t)
			ctx := context.Background()
			release := holdCommitter(t, c)
			const n = 6
			errs := make([]error, n)
			var wg sync.WaitGroup
			for i := range n {
				if i > 0 {
					// In order, so the breaking write (2) runs after two
					// others in the same group.
					waitQueued(t, c, int64(i))
				}
				wg.Go(func() {
					errs[i] = c.tx(ctx, func(tx *sql.Tx) error {
						if _, err := tx.ExecContext(ctx, `INSERT INTO route_events (id, sandbox_id, at_ms) VALUES (?, 'b', 1)`, fmt.Sprint("b", i)); err != nil {
							return err
						}
						if i == 2 {
							if _, err := tx.ExecContext(ctx, `ROLLBACK`); err != nil {
								return err
							}
							if !swallow {
								return errors.New("write 2 broke the transaction")
							}
						}
						return nil
					})
				})
			}
			waitQueued(t, c, n)
			if err := release(); err != nil {
				t.Fatal(err)
			}
			wg.Wait()
			for i, err := range errs {
				if (i == 2) != (err != nil) {
					t.Errorf("write %d: %v", i, err)
				}
			}
			t.Logf("the breaking write's caller hears: %v", errs[2])
			if got := countRows(t, c, "sandbox_id = 'b'"); got != n-1 {
				t.Errorf("%d rows committed, want %d", got, n-1)
			}
			if got := countRows(t, c, "id = 'b2'"); got != 0 {
				t.Errorf("the breaking write's row is there")
			}
		})
	}
}

// TestGroupCommitClose: Close answers the writes already handed over,
// and a write after Close fails instead of waiting.
func TestGroupCommitClose(t *testing.T) {
	c := openSQLite(t)
	ctx := context.Background()
	release := holdCommitter(t, c)
	errc := make(chan error, 1)
	go func() {
		_, err := c.exec(ctx, `INSERT INTO route_events (id, sandbox_id, at_ms) VALUES ('queued', 'c', 1)`)
		errc <- err
	}()
	waitQueued(t, c, 1)
	closed := make(chan error, 1)
	go func() { closed <- c.Close() }()
	if err := release(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-closed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return")
	}
	select {
	case err := <-errc:
		// Handed over before the stop (then committed) or refused.
		if err != nil && !errors.Is(err, errCatalogClosed) {
			t.Fatalf("queued write: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a write queued at Close was never answered")
	}
	if _, err := c.exec(ctx, `INSERT INTO route_events (id, sandbox_id, at_ms) VALUES ('late', 'c', 1)`); !errors.Is(err, errCatalogClosed) {
		t.Fatalf("write after Close: %v, want %v", err, errCatalogClosed)
	}
}
