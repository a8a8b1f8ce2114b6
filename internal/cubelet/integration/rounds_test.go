package integration

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/network/nettest"
)

// TestGvisorRepeatedSnapshots takes a memory snapshot of one running
// gVisor sandbox, dirties its memory and disk, and rolls back to it, round
// after round (2; CUBE_GVISOR_ROUNDS=50 for the long form): after every
// rollback the agent's memory, a live shell's variable and a file hold
// that round's values.
func TestGvisorRepeatedSnapshots(t *testing.T) {
	cubelettest.RequireRoot(t)
	requireRunsc(t)
	rounds := 2
	if v, err := strconv.Atoi(os.Getenv("CUBE_GVISOR_ROUNDS")); err == nil && v > 0 {
		rounds = v
	}
	ctx := context.Background()
	env := cubelettest.New(t, "")
	env.StartNetworkAgent(t, nettest.Options{PoolSize: 2})
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	a := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "gr-a", Runtime: "gvisor"})
	defer func() {
		if _, err := svc.Delete(ctx, a.ID); err != nil {
			t.Error(err)
		}
		for _, sn := range listSnaps(t, svc, "") {
			_ = svc.DeleteSnapshot(ctx, sn)
		}
		assertSnapshotFiles(t, env, svc)
		env.AssertNoLeaks(t)
	}()
	begin := time.Now()
	prev := ""
	for i := range rounds {
		v := fmt.Sprintf("round-%d", i)
		setMemory(t, svc, a.ID, map[string]string{"SECRET": v})
		// The previous round's counter goes (every sh but this one).
		shell(t, svc, a.ID, `for p in $(pidof sh); do [ $p != $$ ] && kill $p; done; echo `+v+` > /root/f`)
		counter(t, svc, a.ID, v)
		sn := mustSnapshot(t, svc, cubelet.SnapshotRequest{SandboxID: a.ID, SnapshotID: fmt.Sprintf("gr-%d", i)})
		if !sn.HasMemory {
			t.Fatalf("round %d: snapshot without memory", i)
		}
		setMemory(t, svc, a.ID, map[string]string{"SECRET": "dirty"})
		shell(t, svc, a.ID, "echo dirty > /root/f")
		if _, err := svc.Rollback(ctx, cubelet.RollbackRequest{SandboxID: a.ID, SnapshotID: sn.ID}); err != nil {
			t.Fatalf("round %d: rollback: %v", i, err)
		}
		mustState(t, svc, a.ID, lifecycle.Running)
		wantMemory(t, svc, a.ID, map[string]string{"SECRET": v})
		holds(t, svc, a.ID, v)
		if got := shell(t, svc, a.ID, "cat /root/f"); got != v {
			t.Fatalf("round %d: file holds %q, want %q", i, got, v)
		}
		// The previous round's snapshot is no longer the sandbox's source.
		if prev != "" {
			if err := svc.DeleteSnapshot(ctx, prev); err != nil {
				t.Fatalf("round %d: delete snapshot %s: %v", i, prev, err)
			}
		}
		prev = sn.ID
	}
	t.Logf("%d snapshot/rollback rounds with memory and file checks took %s", rounds, time.Since(begin).Round(time.Millisecond))
}
