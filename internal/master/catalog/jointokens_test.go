package catalog_test

import (
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// TestJoinTokenSpentOnce: 20 callers racing for one token: exactly one
// spends it (the UPDATE decides); the others are Unauthenticated.
func TestJoinTokenSpentOnce(t *testing.T) {
	c, err := catalog.Open(ctx, catalog.SQLite, filepath.Join(t.TempDir(), "catalog.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.CreateJoinToken(ctx, "tok1", "hash1", "", time.Hour); err != nil {
		t.Fatal(err)
	}
	var won, refused atomic.Int32
	var wg sync.WaitGroup
	for range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			switch err := c.UseJoinToken(ctx, "tok1", "hash1", "n1", false); {
			case err == nil:
				won.Add(1)
			case errdefs.IsUnauthenticated(err):
				refused.Add(1)
			default:
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if won.Load() != 1 || refused.Load() != 19 {
		t.Fatalf("%d spent it, %d refused; want 1 and 19", won.Load(), refused.Load())
	}
}
