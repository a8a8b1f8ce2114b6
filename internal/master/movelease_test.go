package master_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/catalog/catalogtest"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/objstore/objstoretest"
)

// TestMoveThatLostItsLease: a master on a shared (MariaDB) catalog moves
// a paused sandbox off its cordoned node (a resume). Right before the
// move's row would switch the sandbox's node (failpoint move/commit),
// another holder takes the move's lease (as another replica would once
// the lease expired): the move does not commit (the row never names the
// other node, which no longer holds the sandbox's copy; the resume falls
// back to the cordoned node, as for any failed move), and the move's
// context ends at its next renewal, which finds the lease taken. Control:
// the same move with its lease kept, held as long at the same point,
// commits (the row names the other node) and its context does not end.
func TestMoveThatLostItsLease(t *testing.T) {
	db := catalogtest.StartMariaDB(t)
	dsn := db.NewDatabase(t)
	srv := objstoretest.Start(t)
	store := fmt.Sprintf("[store]\nendpoint = %q\nbucket = %q\naccess_key_file = %q\nsecret_key_file = %q\n",
		srv.Endpoint, srv.Bucket, srv.AccessKeyFile, srv.SecretKeyFile)
	m := mastertest.StartMaster(t, fmt.Sprintf("[catalog]\ndriver = \"mysql\"\ndsn = %q\n[ha]\nreplica_id = \"a\"\nlease_ttl = \"2s\"\n[sandbox]\nmilli_cpu = 100\n", dsn))
	n1 := mastertest.StartNodeConfig(t, m, noVM+store, "busybox")
	n2 := mastertest.StartNodeConfig(t, m, noVM+store, "busybox")
	m.WaitHealthy(t, n1, n2)
	svc := m.Server.Service
	ctx := context.Background()
	cat, err := catalog.Open(ctx, catalog.MySQL, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cat.Close() })

	var stopped bool
	move := func(t *testing.T, takeLease bool) (before, after *catalog.Sandbox, err error) {
		t.Helper()
		stopped = false
		sb, err := svc.Create(ctx, master.CreateRequest{Template: "busybox", Timeout: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = svc.Kill(context.Background(), sb.ID) })
		if err := svc.Pause(ctx, sb.ID); err != nil {
			t.Fatal(err)
		}
		if _, err := svc.SetSchedulable(ctx, sb.NodeID, false); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _, _ = svc.SetSchedulable(context.Background(), sb.NodeID, true) })
		if err := failpoint.EnableFunc("move/commit", func(ctx context.Context) error {
			if takeLease {
				// Another process of the same replica takes it over, as
				// another replica would once it expired: a new holder, a
				// new token.
				l, ok, err := cat.AcquireLease(ctx, "move/"+sb.ID, "a#intruder", "a", 5*time.Second, true)
				t.Logf("mid-move, another holder takes the move's lease: ok=%v holder=%s token=%d err=%v", ok, l.Holder, l.Token, err)
				if err != nil || !ok {
					return fmt.Errorf("taking the lease failed: %v", err)
				}
			}
			// Past the next renewal (every third of the 10 s TTL): the
			// move's context ends when that renewal finds the lease
			// taken.
			select {
			case <-ctx.Done():
				stopped = true
				t.Logf("the move's context ended: %v", context.Cause(ctx))
			case <-time.After(4 * time.Second):
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { failpoint.Disable("move/commit") })
		_, err = svc.Resume(ctx, sb.ID, time.Minute)
		after, gerr := cat.GetSandbox(ctx, sb.ID)
		if gerr != nil {
			t.Fatal(gerr)
		}
		_, _ = svc.SetSchedulable(ctx, sb.NodeID, true)
		return sb, after, err
	}

	t.Run("lease kept: commits", func(t *testing.T) {
		sb, after, err := move(t, false)
		t.Logf("resume with its node cordoned, lease kept: err=%v; row on %s (was %s), %s", err, after.NodeID, sb.NodeID, after.State)
		if err != nil || after.NodeID == sb.NodeID || after.State != catalog.StateRunning || stopped {
			t.Fatalf("control: err=%v row %+v, stopped %v; want moved and running, not stopped", err, after, stopped)
		}
	})
	t.Run("lease taken mid-move: does not commit", func(t *testing.T) {
		sb, after, err := move(t, true)
		t.Logf("resume with its node cordoned, lease taken: err=%v; row on %s (was %s), %s", err, after.NodeID, sb.NodeID, after.State)
		if after.NodeID != sb.NodeID {
			t.Fatalf("row %+v: the move committed without its lease", after)
		}
		if !stopped {
			t.Errorf("the move's context did not end when a renewal found its lease taken")
		}
		for _, n := range []*mastertest.Node{n1, n2} {
			if _, gerr := n.Svc.Get(ctx, sb.ID); n.ID != sb.NodeID && gerr == nil {
				t.Errorf("node %s still holds the copy the move started", n.ID)
			}
		}
	})
}
