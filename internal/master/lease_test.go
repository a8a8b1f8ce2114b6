package master_test

import (
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/master/mastertest"
)

// TestLeaseSingleReplica: on its SQLite catalog a lone master holds the
// loops' lease from the start (token 1), and a restart takes it again at
// once with a new token (the same replica's earlier process is gone).
func TestLeaseSingleReplica(t *testing.T) {
	m := mastertest.StartMaster(t, "")
	held := func() (bool, int64) {
		h, tok, _ := m.Server.Service.Lease()
		return h, tok
	}
	mastertest.WaitFor(t, 5*time.Second, "the lease held", func() bool { h, _ := held(); return h })
	if _, tok := held(); tok != 1 {
		t.Fatalf("token %d, want 1", tok)
	}
	m.Stop()
	begin := time.Now()
	m.Start()
	mastertest.WaitFor(t, 5*time.Second, "the lease held after a restart", func() bool { h, _ := held(); return h })
	if _, tok := held(); tok != 2 {
		t.Fatalf("token after restart %d, want 2", tok)
	}
	t.Logf("lease held again %s after the restart began", time.Since(begin).Round(time.Millisecond))
}
