package master_test

import (
	"context"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/mastertest"
)

// stalledCubelet is a node API that accepts every call and never answers
// (until the caller gives up): a cubelet wedged on a stuck mount, say.
type stalledCubelet struct {
	cubeletpb.UnimplementedCubeletServiceServer
	calls atomic.Int64
}

func (s *stalledCubelet) stall(ctx context.Context) error {
	s.calls.Add(1)
	<-ctx.Done()
	return ctx.Err()
}

func (s *stalledCubelet) DeleteSandbox(ctx context.Context, _ *cubeletpb.DeleteSandboxRequest) (*cubeletpb.DeleteSandboxResponse, error) {
	return nil, s.stall(ctx)
}

func (s *stalledCubelet) GetSandbox(ctx context.Context, _ *cubeletpb.GetSandboxRequest) (*cubeletpb.GetSandboxResponse, error) {
	return nil, s.stall(ctx)
}

func (s *stalledCubelet) ListSandboxes(ctx context.Context, _ *cubeletpb.ListSandboxesRequest) (*cubeletpb.ListSandboxesResponse, error) {
	return nil, s.stall(ctx)
}

func (s *stalledCubelet) PauseSandbox(ctx context.Context, _ *cubeletpb.PauseSandboxRequest) (*cubeletpb.PauseSandboxResponse, error) {
	return nil, s.stall(ctx)
}

// TestExpiryHungNode: a node whose API accepts calls and never answers
// (its cubelet still heartbeats, so it stays healthy) cannot stop
// deadlines on another node. The hung node's sandbox expires first, so
// an expiry that works through deadlines one call at a time, unbounded,
// would wait on it forever; with one worker per node and a per-call
// timeout, the other node's sandbox is killed at its deadline, the hung
// one's is retried, and killed once its node answers again.
func TestExpiryHungNode(t *testing.T) {
	m := mastertest.StartMaster(t, "[sandbox]\nexpiry_call_timeout = \"2s\"\n")
	good := mastertest.StartNode(t, m, "busybox")
	hung := mastertest.StartNode(t, m, "busybox")
	m.WaitHealthy(t, good, hung)
	ctx := context.Background()
	svc := func() *master.Service { return m.Server.Service }
	on := func(n, other *mastertest.Node) string {
		t.Helper()
		for _, sched := range []struct {
			n  *mastertest.Node
			ok bool
		}{{other, false}, {n, true}} {
			if _, err := m.Admin.SetNodeSchedulable(ctx, &masterpb.SetNodeSchedulableRequest{NodeId: sched.n.ID, Schedulable: sched.ok}); err != nil {
				t.Fatal(err)
			}
		}
		sb, err := svc().Create(ctx, master.CreateRequest{Template: "busybox", Timeout: time.Hour})
		if err != nil {
			t.Fatal(err)
		}
		if sb.NodeID != n.ID {
			t.Fatalf("sandbox placed on %s, want %s", sb.NodeID, n.ID)
		}
		return sb.ID
	}
	onHung := on(hung, good)
	onGood := on(good, hung)

	// Wedge the hung node's API: the same socket, a server that stalls.
	hung.StopAPI()
	sock := hung.Env.Config.API.Socket
	_ = os.Remove(sock)
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	stalled := &stalledCubelet{}
	gs := grpc.NewServer()
	cubeletpb.RegisterCubeletServiceServer(gs, stalled)
	go func() { _ = gs.Serve(ln) }()
	unwedged := false
	unwedge := func() {
		if !unwedged {
			unwedged = true
			gs.Stop()
			hung.StartAPI()
		}
	}
	t.Cleanup(unwedge)

	// The hung node's sandbox is due first.
	if err := svc().SetTimeout(ctx, onHung, time.Second); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	if err := svc().SetTimeout(ctx, onGood, time.Second); err != nil {
		t.Fatal(err)
	}
	due := time.Now().Add(time.Second)
	mastertest.WaitFor(t, 15*time.Second, "the good node's sandbox killed at its deadline", func() bool {
		_, err := svc().Get(ctx, onGood)
		return errdefs.IsNotFound(err) && !onNode(ctx, good, onGood)
	})
	t.Logf("good node's sandbox killed %s after its deadline; the hung node was called %d time(s)",
		time.Since(due).Round(10*time.Millisecond), stalled.calls.Load())
	if stalled.calls.Load() == 0 {
		t.Fatal("expiry never called the hung node: the test proves nothing")
	}
	if time.Since(due) > 5*time.Second {
		t.Errorf("the good node's sandbox outlived its deadline by %s", time.Since(due))
	}
	if !m.Node(t, hung.ID).Healthy {
		t.Fatal("the hung node is not healthy: expiry may have dropped its sandbox for that reason")
	}
	if _, err := svc().Get(ctx, onHung); err != nil {
		t.Fatalf("the hung node's sandbox row: %v (it must stay until its node confirms the kill)", err)
	}

	unwedge()
	mastertest.WaitFor(t, 30*time.Second, "the hung node's sandbox killed once it answers", func() bool {
		_, err := svc().Get(ctx, onHung)
		return errdefs.IsNotFound(err) && !onNode(ctx, hung, onHung)
	})
	good.Env.AssertNoLeaks(t)
	hung.Env.AssertNoLeaks(t)
}
