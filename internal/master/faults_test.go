package master_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/mastertest"
)

// TestFaults drives the master's failure paths with failpoints that
// return errors, and checks that the node ends up holding exactly what
// the catalog says (the leak checker has the last word).
func TestFaults(t *testing.T) {
	m := mastertest.StartMaster(t, "")
	node := mastertest.StartNode(t, m, "busybox")
	m.WaitHealthy(t, node)
	ctx := context.Background()
	svc := func() *master.Service { return m.Server.Service }
	onNode := func(id string) bool {
		_, err := node.Client.GetSandbox(ctx, &cubeletpb.GetSandboxRequest{SandboxId: id})
		return err == nil
	}
	nodeCount := func() int {
		resp, err := node.Client.ListSandboxes(ctx, &cubeletpb.ListSandboxesRequest{})
		if err != nil {
			t.Fatal(err)
		}
		return len(resp.Sandboxes)
	}

	t.Run("create fails after the node made the sandbox", func(t *testing.T) {
		if err := failpoint.Enable("master/create/placed", "1*error(agent unreachable)"); err != nil {
			t.Fatal(err)
		}
		defer failpoint.Disable("master/create/placed")
		_, err := svc().Create(ctx, master.CreateRequest{Template: "busybox"})
		if !errors.Is(err, failpoint.ErrInjected) {
			t.Fatalf("create: %v", err)
		}
		if n := nodeCount(); n != 0 {
			t.Fatalf("%d sandbox(es) left on the node", n)
		}
		if rows, _ := svc().ListAll(ctx, catalog.Query{}); len(rows) != 0 {
			t.Fatalf("%d catalog row(s) left", len(rows))
		}
	})

	t.Run("kill fails between the node and the catalog", func(t *testing.T) {
		sb, err := svc().Create(ctx, master.CreateRequest{Template: "busybox"})
		if err != nil {
			t.Fatal(err)
		}
		if err := failpoint.Enable("master/kill/deleted", "1*error"); err != nil {
			t.Fatal(err)
		}
		defer failpoint.Disable("master/kill/deleted")
		if err := svc().Kill(ctx, sb.ID); !errors.Is(err, failpoint.ErrInjected) {
			t.Fatalf("kill: %v", err)
		}
		if onNode(sb.ID) {
			t.Fatal("node still has the sandbox")
		}
		// The row outlived its sandbox; killing again finishes the job
		// (the node answers NotFound, which kill accepts).
		if err := svc().Kill(ctx, sb.ID); err != nil {
			t.Fatalf("second kill: %v", err)
		}
		if _, err := svc().Get(ctx, sb.ID); !errdefs.IsNotFound(err) {
			t.Fatalf("row: %v", err)
		}
	})

	// A master killed mid-verb, for real, at every failpoint: TestMasterKilled.

	t.Run("refused creates leave nothing", func(t *testing.T) {
		// Every node refuses (its API is down while it still heartbeats):
		// the node is healthy, so a 429-class error the client retries
		// (never a 503), and once the node answers again no row and
		// nothing on the node. The create waits for the node
		// (nodes.restart_wait) until its client gives up.
		node.StopAPI()
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		_, err := svc().Create(cctx, master.CreateRequest{Template: "busybox"})
		cancel()
		node.StartAPI()
		if !errdefs.IsResourceExhausted(err) || !strings.Contains(err.Error(), "no node can take the sandbox") {
			t.Fatalf("create with the only node unreachable: %v", err)
		}
		mastertest.WaitFor(t, 10*time.Second, "no catalog row left", func() bool {
			rows, _ := svc().ListAll(ctx, catalog.Query{})
			return len(rows) == 0
		})
	})
	t.Run("a master with a fresh catalog gets its nodes back", func(t *testing.T) {
		m.Stop()
		m.Config.Catalog.DSN += ".fresh"
		m.Start()
		// The cubelet's next heartbeat is answered "not registered" and it
		// registers again on its own.
		m.WaitHealthy(t, node)
		if _, err := svc().Create(ctx, master.CreateRequest{Template: "busybox"}); err != nil {
			t.Fatalf("create on the re-registered node: %v", err)
		}
		rows, _ := svc().ListAll(ctx, catalog.Query{})
		for _, r := range rows {
			if err := svc().Kill(ctx, r.ID); err != nil {
				t.Fatal(err)
			}
		}
	})
	node.Env.AssertNoLeaks(t)
}
