package master_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/mastertest"
)

// TestLostNode: a node that stops heartbeating (its cubelet gone, as with
// a lost host) has its sandboxes marked failed once nodes.lost_after
// has passed, with an event naming the node, while another node's stay
// running; when the node comes back with the sandbox still running, its
// registration's reconcile sets the row back to running. The control is
// the same sandbox before the window: still running.
func TestLostNode(t *testing.T) {
	m := mastertest.StartMaster(t, "[nodes]\nunhealthy_after = \"2s\"\nlost_after = \"2s\"\n")
	a := mastertest.StartNode(t, m, "busybox")
	b := mastertest.StartNode(t, m, "busybox")
	m.WaitHealthy(t, a, b)
	ctx := context.Background()
	svc := m.Server.Service
	on := map[string]*catalog.Sandbox{}
	var ids []string
	t.Cleanup(func() {
		for _, id := range ids {
			_ = svc.Kill(ctx, id)
		}
	})
	for len(on) < 2 {
		sb, err := svc.Create(ctx, master.CreateRequest{Template: "busybox", Timeout: 10 * time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, sb.ID)
		if on[sb.NodeID] == nil {
			on[sb.NodeID] = sb
		}
		if len(ids) > 8 {
			t.Fatal("every sandbox on one node")
		}
	}
	lost, kept := on[a.ID], on[b.ID]
	state := func(id string) string {
		sb, err := svc.Get(ctx, id)
		if err != nil {
			return err.Error()
		}
		return sb.State
	}
	stopped := time.Now()
	a.Stop() // heartbeats stop; the sandbox runs on
	time.Sleep(time.Second)
	if s := state(lost.ID); s != catalog.StateRunning {
		t.Fatalf("control: within the window the silent node's sandbox is %q, want running", s)
	}
	mastertest.WaitFor(t, 15*time.Second, "the silent node's sandbox to be failed", func() bool { return state(lost.ID) == catalog.StateFailed })
	t.Logf("sandbox %s on silent node failed %s after its heartbeats stopped (lost_after 2s)", lost.ID, time.Since(stopped).Round(time.Millisecond))
	if s := state(kept.ID); s != catalog.StateRunning {
		t.Errorf("sandbox on the live node is %q", s)
	}
	if !strings.Contains(m.Logs(), "lost: no heartbeat since") {
		t.Errorf("no event or log naming the lost node")
	}
	a.Start()
	m.WaitHealthy(t, a)
	mastertest.WaitFor(t, 15*time.Second, "the returned node's sandbox to be running again", func() bool { return state(lost.ID) == catalog.StateRunning })
}
