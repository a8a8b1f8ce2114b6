package master_test

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/mastertest"
)

// TestCreateWaits: with one node, a create the node cannot take right now
// waits for it (nodes.restart_wait) instead of failing: while the node is
// over its create limit, and while its API is down (a cubelet
// restarting). Each case's control is the same create from a client that
// gives up after 300 ms: it fails (429), so the probe needs the wait to
// succeed; and nothing is left of it once the node answers.
func TestCreateWaits(t *testing.T) {
	m := mastertest.StartMaster(t, "")
	n := mastertest.StartNode(t, m, "busybox")
	m.WaitHealthy(t, n)
	ctx := context.Background()
	svc := func() *master.Service { return m.Server.Service }
	c := m.API(m.APIKey(t))
	create := func(t *testing.T) (string, time.Duration) {
		t.Helper()
		start := time.Now()
		var sb e2bSandbox
		if r := c.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox"}, &sb); r.StatusCode != http.StatusCreated {
			t.Fatalf("create: %d %s", r.StatusCode, r.Body)
		}
		t.Cleanup(func() { c.Do(t, "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil) })
		return sb.SandboxID, time.Since(start)
	}
	impatient := func(t *testing.T) {
		t.Helper()
		cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		defer cancel()
		if _, err := svc().Create(cctx, master.CreateRequest{Template: "busybox"}); !errdefs.IsResourceExhausted(err) {
			t.Fatalf("control, a client that gives up at once: %v, want ResourceExhausted", err)
		}
		t.Log("control: a client that does not wait gets ResourceExhausted")
	}
	noRows := func(t *testing.T) {
		t.Helper()
		mastertest.WaitFor(t, 10*time.Second, "no row of the failed create", func() bool {
			rows, _ := svc().ListAll(ctx, catalog.Query{})
			return len(rows) == 0
		})
	}

	t.Run("node over its create limit", func(t *testing.T) {
		if _, err := n.Client.SetFlowLimit(ctx, &cubeletpb.SetFlowLimitRequest{Flow: "create", Limit: 1}); err != nil {
			t.Fatal(err)
		}
		defer func() {
			if _, err := n.Client.SetFlowLimit(ctx, &cubeletpb.SetFlowLimitRequest{Flow: "create", Limit: 64}); err != nil {
				t.Errorf("restore the create limit: %v", err)
			}
		}()
		// Hold the node's only create slot with a slow create of its own.
		hold := func() *sync.WaitGroup {
			if err := failpoint.Enable("create/disk", "1*sleep(1500ms)"); err != nil {
				t.Fatal(err)
			}
			var wg sync.WaitGroup
			wg.Go(func() {
				id := "slow-" + time.Now().Format("150405.000000")[7:]
				if _, err := n.Client.CreateSandbox(ctx, &cubeletpb.CreateSandboxRequest{SandboxId: id, TemplateId: "busybox"}); err != nil {
					t.Errorf("direct create: %v", err)
					return
				}
				if _, err := n.Client.DeleteSandbox(ctx, &cubeletpb.DeleteSandboxRequest{SandboxId: id}); err != nil {
					t.Errorf("delete the direct create: %v", err)
				}
			})
			mastertest.WaitFor(t, 10*time.Second, "the create slot taken", func() bool {
				resp, err := n.Client.ListFlows(ctx, &cubeletpb.ListFlowsRequest{})
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
			return &wg
		}
		defer failpoint.Disable("create/disk")
		wg := hold()
		impatient(t)
		wg.Wait()
		noRows(t)

		wg = hold()
		_, d := create(t)
		wg.Wait()
		if d < time.Second {
			t.Fatalf("created in %s while the node's only create slot was held for 1.5 s", d)
		}
		t.Logf("create through the E2B API while the node's create slot was held: 201 after %s", d.Round(time.Millisecond))
	})

	t.Run("node API down", func(t *testing.T) {
		n.StopAPI() // heartbeats go on: the node stays healthy
		impatient(t)
		n.StartAPI()
		noRows(t)

		n.StopAPI()
		restarted := make(chan struct{})
		go func() {
			defer close(restarted)
			time.Sleep(1500 * time.Millisecond)
			n.StartAPI()
		}()
		_, d := create(t)
		<-restarted
		if d < time.Second {
			t.Fatalf("created in %s while the node's API was down for 1.5 s", d)
		}
		t.Logf("create through the E2B API while the node's API was down for 1.5 s: 201 after %s", d.Round(time.Millisecond))
	})
}
