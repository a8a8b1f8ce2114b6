package master_test

import (
	"context"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/proxy"
)

// TestCluster runs one master over three real cubelets on this machine
// (each with its own data dir, pool, runc root, cgroup parent and API
// socket) and checks placement, retries, heartbeat loss, node restarts and
// a master restart, in that order, on the same cluster.
func TestCluster(t *testing.T) {
	// Locality off: placement then depends only on load and sandbox
	// count, which the steps below arrange.
	m := mastertest.StartMaster(t, "[scheduler.weights]\nload = 1.0\nlocality = 0.0\nspread = 0.5\n")
	a := mastertest.StartNode(t, m, "busybox")
	b := mastertest.StartNode(t, m, "busybox", "only2")
	c := mastertest.StartNode(t, m, "busybox", "only2")
	m.WaitHealthy(t, a, b, c)
	ctx := context.Background()
	svc := func() *master.Service { return m.Server.Service }
	names := map[string]string{a.ID: "A", b.ID: "B", c.ID: "C"}
	var all []*catalog.Sandbox
	create := func(t *testing.T, tmpl string) *catalog.Sandbox {
		t.Helper()
		sb, err := svc().Create(ctx, master.CreateRequest{Template: tmpl, Timeout: 10 * time.Minute})
		if err != nil {
			t.Fatalf("create %s: %v", tmpl, err)
		}
		all = append(all, sb)
		return sb
	}
	count := func(sbs []*catalog.Sandbox) map[string]int {
		out := map[string]int{}
		for _, s := range sbs {
			out[names[s.NodeID]]++
		}
		return out
	}

	t.Run("filter by template and spread", func(t *testing.T) {
		var got []*catalog.Sandbox
		for range 4 {
			got = append(got, create(t, "only2"))
		}
		if n := count(got); n["A"] != 0 || n["B"] != 2 || n["C"] != 2 {
			t.Fatalf("placement %v: want 2 on B, 2 on C, none on A (no template)", n)
		}
	})

	t.Run("cordon", func(t *testing.T) {
		if _, err := m.Admin.SetNodeSchedulable(ctx, &masterpb.SetNodeSchedulableRequest{NodeId: b.ID, Schedulable: false}); err != nil {
			t.Fatal(err)
		}
		got := []*catalog.Sandbox{create(t, "only2"), create(t, "only2")}
		if n := count(got); n["C"] != 2 {
			t.Fatalf("placement %v with B cordoned", n)
		}
		if _, err := m.Admin.SetNodeSchedulable(ctx, &masterpb.SetNodeSchedulableRequest{NodeId: b.ID, Schedulable: true}); err != nil {
			t.Fatal(err)
		}
	})
	// Now A has no sandboxes, B and C have some: A is the first choice for
	// busybox (load and spread).

	t.Run("retry when a healthy node is unreachable", func(t *testing.T) {
		a.StopAPI() // heartbeats go on: the master still sees A healthy
		defer a.StartAPI()
		if v := m.Node(t, a.ID); !v.Healthy {
			t.Fatalf("A unhealthy: %s", v.Reason)
		}
		// A, with no sandboxes, is everyone's first choice.
		sb := create(t, "busybox")
		if names[sb.NodeID] == "A" || sb.NodeID == "" {
			t.Fatalf("landed on %q: A cannot be reached, the master should have moved on", names[sb.NodeID])
		}
	})

	t.Run("retry when a node is over its create limit", func(t *testing.T) {
		if _, err := a.Client.SetFlowLimit(ctx, &cubeletpb.SetFlowLimitRequest{Flow: "create", Limit: 1}); err != nil {
			t.Fatal(err)
		}
		defer func() {
			if _, err := a.Client.SetFlowLimit(ctx, &cubeletpb.SetFlowLimitRequest{Flow: "create", Limit: 64}); err != nil {
				t.Errorf("restore the create limit: %v", err)
			}
		}()
		// The master's connection to A, down in the step before, must be
		// back, so that A refuses for its limit and not for that: an
		// import of a template A has is a no-op through the master.
		mastertest.WaitFor(t, 10*time.Second, "the master reaching A again", func() bool {
			_, err := m.Admin.ImportTemplate(ctx, &masterpb.ImportTemplateRequest{TemplateId: "busybox", Source: a.Env.Image, NodeId: a.ID})
			return err == nil
		})
		// Hold A's only create slot with a slow create of its own.
		if err := failpoint.Enable("create/disk", "1*sleep(3s)"); err != nil {
			t.Fatal(err)
		}
		defer failpoint.Disable("create/disk")
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := a.Client.CreateSandbox(ctx, &cubeletpb.CreateSandboxRequest{SandboxId: "slow-direct", TemplateId: "busybox"}); err != nil {
				t.Errorf("direct create: %v", err)
			}
		}()
		mastertest.WaitFor(t, 10*time.Second, "A's create slot taken", func() bool {
			resp, err := a.Client.ListFlows(ctx, &cubeletpb.ListFlowsRequest{})
			if err != nil {
				return false
			}
			for _, f := range resp.Flows {
				if f.Name == "create" && f.InFlight == 1 {
					return true
				}
			}
			return false
		})
		sb := create(t, "busybox") // A is still the first choice
		if names[sb.NodeID] == "A" || sb.NodeID == "" {
			t.Fatalf("landed on %q: A is over its create limit, the master should have moved on", names[sb.NodeID])
		}
		wg.Wait()
		if _, err := a.Client.DeleteSandbox(ctx, &cubeletpb.DeleteSandboxRequest{SandboxId: "slow-direct"}); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("heartbeat loss", func(t *testing.T) {
		a.Stop()
		mastertest.WaitFor(t, 10*time.Second, "A unhealthy", func() bool { return !m.Node(t, a.ID).Healthy })
		if v := m.Node(t, a.ID); !strings.Contains(v.Reason, "no heartbeat") {
			t.Fatalf("reason: %q", v.Reason)
		}
		got := []*catalog.Sandbox{create(t, "busybox"), create(t, "busybox")}
		if n := count(got); n["A"] != 0 {
			t.Fatalf("placement %v: a sandbox went to the silent node", n)
		}
		a.Start()
		m.WaitHealthy(t, a)
		sb := create(t, "busybox") // A has the fewest sandboxes again
		if names[sb.NodeID] != "A" {
			for _, n := range []*mastertest.Node{a, b, c} {
				r := m.Node(t, n.ID).Report
				t.Logf("%s: busy=%v %q states %v alloc %d", names[n.ID], r.Busy, r.BusyReason, r.SandboxesByState, r.AllocatedMilliCpu)
			}
			t.Fatalf("after A came back, landed on %s", names[sb.NodeID])
		}
	})

	t.Run("kill on a dead node, cleaned up when it returns", func(t *testing.T) {
		var onC *catalog.Sandbox
		for _, s := range all {
			if s.NodeID == c.ID {
				onC = s
				break
			}
		}
		c.Stop()
		mastertest.WaitFor(t, 10*time.Second, "C unhealthy", func() bool { return !m.Node(t, c.ID).Healthy })
		if err := svc().Kill(ctx, onC.ID); err != nil {
			t.Fatalf("kill on a dead node: %v", err)
		}
		if _, err := svc().Get(ctx, onC.ID); !errdefs.IsNotFound(err) {
			t.Fatalf("row kept: %v", err)
		}
		c.Start()
		mastertest.WaitFor(t, 15*time.Second, "C's reconcile to destroy the orphan", func() bool {
			_, err := c.Client.GetSandbox(ctx, &cubeletpb.GetSandboxRequest{SandboxId: onC.ID})
			return err != nil && strings.Contains(err.Error(), "not found")
		})
		all = remove(all, onC.ID)
	})

	t.Run("master restart", func(t *testing.T) {
		before, _, err := svc().List(ctx, catalog.Query{Ascending: true})
		if err != nil {
			t.Fatal(err)
		}
		m.Stop()
		m.Start()
		after, _, err := svc().List(ctx, catalog.Query{Ascending: true})
		if err != nil {
			t.Fatal(err)
		}
		if len(after) != len(before) || len(after) != len(all) {
			t.Fatalf("%d sandboxes before, %d after, %d created", len(before), len(after), len(all))
		}
		for i := range before {
			if before[i].ID != after[i].ID || !before[i].EndAt.Equal(after[i].EndAt) || before[i].NodeID != after[i].NodeID {
				t.Fatalf("catalog changed: %+v vs %+v", before[i], after[i])
			}
		}
		// Reachable through the new master's route at once: it knows the
		// nodes from the catalog, before any heartbeat.
		for _, s := range after {
			req, _ := http.NewRequest("GET", "http://"+m.Server.ProxyAddr+"/health", nil)
			req.Header.Set(proxy.HeaderSandboxID, s.ID)
			req.Header.Set(proxy.HeaderSandboxPort, "49983")
			resp, err := http.DefaultClient.Do(req)
			if err != nil || resp.StatusCode != http.StatusNoContent {
				t.Fatalf("sandbox %s on %s after restart: %v %v", s.ID, names[s.NodeID], resp, err)
			}
			resp.Body.Close()
		}
		m.WaitHealthy(t, a, b, c)
	})

	t.Run("kill everything", func(t *testing.T) {
		rows, err := svc().ListAll(ctx, catalog.Query{})
		if err != nil {
			t.Fatal(err)
		}
		if len(rows) != len(all) {
			t.Errorf("catalog has %d sandboxes, the test made %d", len(rows), len(all))
		}
		for _, s := range rows {
			if err := svc().Kill(ctx, s.ID); err != nil {
				t.Errorf("kill %s: %v", s.ID, err)
			}
		}
		for _, n := range []*mastertest.Node{a, b, c} {
			n.Env.AssertNoLeaks(t)
		}
	})
}

func remove(sbs []*catalog.Sandbox, id string) []*catalog.Sandbox {
	out := sbs[:0]
	for _, s := range sbs {
		if s.ID != id {
			out = append(out, s)
		}
	}
	return out
}
