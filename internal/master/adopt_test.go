package master_test

import (
	"context"
	"testing"
	"time"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/mastertest"
)

// TestAdoption: when a node registers holding managed sandboxes the
// catalog has no row for, reconcile
//
//   - destroys one the master removed on purpose (killed while its node
//     was away: a tombstone), however recent;
//   - adopts a recent one whose row the catalog lost (here: the master
//     comes back on a new, empty catalog), keeping its node, team,
//     template and deadline, and keeping a private route closed;
//   - destroys one older than sandbox.adopt_window, as before.
func TestAdoption(t *testing.T) {
	const window = 8 * time.Second
	m := mastertest.StartMaster(t, "[sandbox]\nadopt_window = \"8s\"\n")
	node := mastertest.StartNode(t, m, "busybox")
	m.WaitHealthy(t, node)
	ctx := context.Background()
	svc := func() *master.Service { return m.Server.Service }
	create := func(private bool) *catalog.Sandbox {
		t.Helper()
		req := master.CreateRequest{Template: "busybox", Timeout: time.Hour}
		if private {
			no := false
			req.Network.AllowPublicTraffic = &no
		}
		sb, err := svc().Create(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		return sb
	}

	old := create(false)
	oldMade := time.Now()

	t.Run("killed while its node was away: destroyed, not adopted", func(t *testing.T) {
		away := create(false)
		kept := create(false)
		node.Stop()
		mastertest.WaitFor(t, 15*time.Second, "node unhealthy", func() bool {
			n := m.Node(t, node.ID)
			return n != nil && !n.Healthy
		})
		// The node is gone: the row goes, the sandbox stays on the node.
		if err := svc().Kill(ctx, away.ID); err != nil {
			t.Fatal(err)
		}
		node.Start()
		m.WaitHealthy(t, node)
		mastertest.WaitFor(t, 20*time.Second, "reconcile destroys the killed sandbox", func() bool {
			return !onNode(ctx, node, away.ID)
		})
		if _, err := svc().Get(ctx, away.ID); !errdefs.IsNotFound(err) {
			t.Fatalf("killed sandbox came back: %v", err)
		}
		if !onNode(ctx, node, kept.ID) {
			t.Fatal("reconcile destroyed a sandbox with a row")
		}
		t.Logf("killed %s while the node was away; reconcile destroyed it (%s old, inside the %s window: the tombstone decided)",
			away.ID, time.Since(away.StartedAt).Round(time.Second), window)
	})

	// Make "old" older than the window, then a recent private one.
	if d := window + time.Second - time.Since(oldMade); d > 0 {
		time.Sleep(d)
	}
	recent := create(true)
	before := adminRows(t, m)

	// The catalog is lost: the master comes back on an empty one.
	m.Stop()
	m.Config.Catalog.DSN += ".lost"
	m.Start()
	m.WaitHealthy(t, node)
	mastertest.WaitFor(t, 20*time.Second, "reconcile of the lost catalog", func() bool {
		if _, err := svc().Get(ctx, recent.ID); err != nil {
			return false
		}
		for id := range before {
			if id != recent.ID && onNode(ctx, node, id) {
				return false
			}
		}
		return true
	})
	if time.Since(recent.StartedAt) >= window {
		t.Fatalf("the reconcile came %s after the recent create, beyond the %s window: rerun on a less loaded machine", time.Since(recent.StartedAt), window)
	}

	got, err := svc().Get(ctx, recent.ID)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("adopted %s: node %s team %s state %s deadline in %s", got.ID, got.NodeID, got.Team, got.State, time.Until(got.EndAt).Round(time.Second))
	if got.NodeID != node.ID || got.State != catalog.StateRunning || got.TemplateID != "busybox" || got.Team != recent.Team {
		t.Errorf("adopted row %+v, want node %s, running, busybox, team %q", got, node.ID, recent.Team)
	}
	if d := got.EndAt.Sub(recent.EndAt); d < -5*time.Second || d > 5*time.Second {
		t.Errorf("adopted deadline %s, created with %s", got.EndAt, recent.EndAt)
	}
	if got.TrafficAccessToken == "" || got.TrafficAccessToken == recent.TrafficAccessToken {
		t.Errorf("adopted private sandbox: traffic token %q (created with one): its route must stay closed", got.TrafficAccessToken)
	}
	if !onNode(ctx, node, recent.ID) {
		t.Fatal("the adopted sandbox is gone from its node")
	}
	// Everything older than the window that the new catalog lacks is gone
	// (from the node: the wait above), and has no row.
	if _, ok := before[old.ID]; !ok {
		t.Fatalf("the old sandbox %s had no row before the catalog was lost", old.ID)
	}
	rows := adminRows(t, m)
	for id := range before {
		if id == recent.ID {
			continue
		}
		if _, ok := rows[id]; ok {
			t.Errorf("sandbox %s, older than the window, has a row", id)
		}
	}
	if len(rows) != 1 {
		t.Errorf("rows after adoption: %v, want only %s", rows, recent.ID)
	}
	if err := svc().Kill(ctx, recent.ID); err != nil {
		t.Fatal(err)
	}
	if resp, err := m.Admin.ListSandboxes(ctx, &masterpb.ListSandboxesRequest{}); err != nil || len(resp.Sandboxes) != 0 {
		t.Fatalf("rows left: %v %v", resp, err)
	}
	node.Env.AssertNoLeaks(t)
}
