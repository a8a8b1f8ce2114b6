package integration

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/network/nettest"
)

// tryShell runs script through the agent at base and says whether it
// exited 0 (a client of a sandbox being snapshotted fails now and then).
func tryShell(ctx context.Context, pc processconnect.ProcessClient, script string) error {
	req := connect.NewRequest(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", script}}})
	req.Header().Set("Authorization", "Basic cm9vdDo=")
	s, err := pc.Start(ctx, req)
	if err != nil {
		return err
	}
	defer s.Close()
	var end *pb.ProcessEvent_EndEvent
	for s.Receive() {
		if e := s.Msg().GetEvent().GetEnd(); e != nil {
			end = e
		}
	}
	if err := s.Err(); err != nil {
		return err
	}
	if end == nil || end.GetExitCode() != 0 {
		return fmt.Errorf("%q ended %v", script, end)
	}
	return nil
}

// TestGvisorSnapshotUnderTraffic is what a drain does to a running gVisor
// sandbox whose users keep calling it: clients run commands through its
// agent in a loop while cubelet takes memory snapshots of it (quiesce,
// checkpoint, restore in place, wake) again and again. Every snapshot
// must succeed and the sandbox keep its memory
// (CUBE_GVISOR_TRAFFIC_ROUNDS snapshots, default 4).
func TestGvisorSnapshotUnderTraffic(t *testing.T) {
	cubelettest.RequireRoot(t)
	requireRunsc(t)
	ctx := context.Background()
	rounds := 4
	if v, err := strconv.Atoi(os.Getenv("CUBE_GVISOR_TRAFFIC_ROUNDS")); err == nil && v > 0 {
		rounds = v
	}
	env := cubelettest.New(t, "")
	env.StartNetworkAgent(t, nettest.Options{PoolSize: 2})
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	a := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "gt-a", Runtime: "gvisor"})
	defer func() {
		for _, sb := range mustList(t, svc) {
			if _, err := svc.Delete(ctx, sb.ID); err != nil {
				t.Error(err)
			}
		}
		for _, sn := range listSnaps(t, svc, "") {
			_ = svc.DeleteSnapshot(ctx, sn)
		}
		assertSnapshotFiles(t, env, svc)
		env.AssertNoLeaks(t)
	}()
	orig := fmt.Sprint(time.Now().UnixNano())
	counter(t, svc, a.ID, orig)
	holds(t, svc, a.ID, orig)

	cctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	var ok, failed atomic.Int64
	var lastErr atomic.Value
	base := agentURL(t, svc, a.ID, "")
	for range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			hc := agentClient()
			defer hc.CloseIdleConnections()
			pc := processconnect.NewProcessClient(hc, base)
			for cctx.Err() == nil {
				rctx, rcancel := context.WithTimeout(cctx, 10*time.Second)
				if err := tryShell(rctx, pc, "cat /tmp/v"); err != nil {
					failed.Add(1)
					lastErr.Store(err.Error())
				} else {
					ok.Add(1)
				}
				rcancel()
				select {
				case <-cctx.Done():
				case <-time.After(50 * time.Millisecond):
				}
			}
		}()
	}
	stopClients := func() { cancel(); wg.Wait() }
	defer stopClients()

	bad := 0
	for r := range rounds {
		// Let the clients through between snapshots, as between moves.
		time.Sleep(time.Second)
		if r == 0 && ok.Load() == 0 {
			t.Fatalf("no client call went through before the first snapshot (last error: %v)", lastErr.Load())
		}
		begin := time.Now()
		res, err := svc.Snapshot(ctx, cubelet.SnapshotRequest{SandboxID: a.ID})
		if err != nil {
			bad++
			t.Errorf("round %d: snapshot under traffic (%d client calls ok, %d failed so far): %v", r, ok.Load(), failed.Load(), err)
			sb, gerr := svc.Get(ctx, a.ID)
			t.Logf("round %d: sandbox after the failure: %+v %v", r, sb, gerr)
			if gerr != nil || sb.State != lifecycle.Running {
				break
			}
			continue
		}
		if !res.Snapshot.HasMemory {
			t.Fatalf("round %d: snapshot %+v has no memory", r, res.Snapshot)
		}
		t.Logf("round %d: memory snapshot under traffic in %s (%d client calls ok, %d failed so far, last error %v)", r, time.Since(begin).Round(time.Millisecond), ok.Load(), failed.Load(), lastErr.Load())
		mustState(t, svc, a.ID, lifecycle.Running)
		if err := svc.DeleteSnapshot(ctx, res.Snapshot.ID); err != nil {
			t.Fatal(err)
		}
	}
	stopClients()
	t.Logf("clients: %d calls ok, %d failed (last: %v)", ok.Load(), failed.Load(), lastErr.Load())
	if bad > 0 {
		t.Fatalf("%d of %d snapshots failed under traffic", bad, rounds)
	}
	holds(t, svc, a.ID, orig)
}
