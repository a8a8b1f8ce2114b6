package catalog

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/master/catalog/catalogtest"
)

// TestDeadlockVictimRetried: on MariaDB, two transactions that lock two
// rows in opposite orders deadlock, and InnoDB aborts one; the catalog
// runs the victim again and both complete. The control: with one attempt
// per transaction, the same pair fails with InnoDB's deadlock error.
// Concurrent sandbox deletes, which deadlocked on the tombstone gap
// before it became an upsert, complete without a retry.
func TestDeadlockVictimRetried(t *testing.T) {
	m := catalogtest.StartMariaDB(t)
	ctx := context.Background()
	c, err := Open(ctx, MySQL, m.NewDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for _, id := range []string{"a", "b"} {
		if err := c.CreateSandbox(ctx, &Sandbox{ID: id, TemplateID: "t", State: StateRunning, StartedAt: time.Now()}); err != nil {
			t.Fatal(err)
		}
	}
	// pair runs the two transactions; each takes its first row, waits
	// until the other has taken its own (first attempt only), then the
	// other's row.
	pair := func(attempts int) []error {
		was := txAttempts
		txAttempts = attempts
		defer func() { txAttempts = was }()
		var both sync.WaitGroup
		both.Add(2)
		errs := make([]error, 2)
		var wg sync.WaitGroup
		for i, order := range [][2]string{{"a", "b"}, {"b", "a"}} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				first := true
				errs[i] = c.tx(ctx, func(tx *sql.Tx) error {
					if _, err := tx.ExecContext(ctx, `UPDATE sandboxes SET version = version + 1 WHERE id = ?`, order[0]); err != nil {
						return err
					}
					if first {
						first = false
						both.Done()
						both.Wait()
					}
					_, err := tx.ExecContext(ctx, `UPDATE sandboxes SET version = version + 1 WHERE id = ?`, order[1])
					return err
				})
			}()
		}
		wg.Wait()
		return errs
	}
	control := pair(1)
	t.Logf("control (one attempt): %v", control)
	if !(retryable(control[0]) || retryable(control[1])) {
		t.Fatalf("control: no deadlock between opposite lock orders: %v", control)
	}
	before := c.Retried()
	if errs := pair(txAttempts); errs[0] != nil || errs[1] != nil {
		t.Fatalf("with retries: %v", errs)
	}
	t.Logf("with retries: both committed, %d transaction(s) run again", c.Retried()-before)

	const n = 200
	for i := range n {
		if err := c.CreateSandbox(ctx, &Sandbox{ID: fmt.Sprintf("sb%04d", i), TemplateID: "t", State: StateRunning, StartedAt: time.Now()}); err != nil {
			t.Fatal(err)
		}
	}
	before = c.Retried()
	next := make(chan int, n)
	for i := range n {
		next <- i
	}
	close(next)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var failed []error
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				if err := c.DeleteSandbox(ctx, fmt.Sprintf("sb%04d", i)); err != nil {
					mu.Lock()
					failed = append(failed, err)
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	t.Logf("%d concurrent deletes: %d failed, %d retried", n, len(failed), c.Retried()-before)
	if len(failed) > 0 {
		t.Fatalf("concurrent deletes failed: %v", failed[0])
	}
}
