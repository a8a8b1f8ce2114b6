package integration

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/agent/agenttest"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/network/nettest"
)

// shell runs script as root in sandbox id through its agent (the slot's
// address) and returns its trimmed stdout.
func shell(t *testing.T, svc *cubelet.Service, id, script string) string {
	t.Helper()
	hc := agentClient()
	defer hc.CloseIdleConnections()
	return strings.TrimSpace(agenttest.Shell(context.Background(), t, hc, agentURL(t, svc, id, ""), script))
}

// counter starts a shell in sb that holds value only in its memory and
// writes it to /tmp/v every 100 ms; holds checks that a live process still
// does (the file is removed first, so only that process can bring it back;
// a read that races the writer's truncation is retried).
func counter(t *testing.T, svc *cubelet.Service, id, value string) {
	t.Helper()
	shell(t, svc, id, fmt.Sprintf(`v=%s; (while :; do echo $v > /tmp/v; sleep 0.1; done) </dev/null >/dev/null 2>&1 &`, value))
}

func holds(t *testing.T, svc *cubelet.Service, id, value string) {
	t.Helper()
	got := shell(t, svc, id, `rm -f /tmp/v; for i in $(seq 50); do x=$(cat /tmp/v 2>/dev/null); [ -n "$x" ] && break; sleep 0.1; done; echo $x`)
	if got != value {
		t.Fatalf("%s: in-memory value %q, want %q", id, got, value)
	}
}

// TestGvisorMemorySnapshots drives memory snapshots of gVisor sandboxes
// end to end in cubelet with Debian's runsc: the agent is quiesced for
// the checkpoint and woken after each restore.
func TestGvisorMemorySnapshots(t *testing.T) {
	cubelettest.RequireRoot(t)
	requireRunsc(t)
	ctx := context.Background()
	clones := 10 // N=10 at once; CUBE_GVISOR_CLONES overrides
	if v, err := strconv.Atoi(os.Getenv("CUBE_GVISOR_CLONES")); err == nil && v > 0 {
		clones = v
	}
	env := cubelettest.New(t, "")
	env.StartNetworkAgent(t, nettest.Options{PoolSize: clones + 2})
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")

	a := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "gm-a", Runtime: "gvisor"})
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
	// PID 1 holds CAP_SYS_ADMIN (to set a clone's hostname); what it
	// starts must not, even as root.
	for _, f := range []string{"CapEff", "CapBnd"} {
		line := shell(t, svc, a.ID, "grep "+f+" /proc/self/status")
		v, err := strconv.ParseUint(strings.TrimSpace(strings.TrimPrefix(line, f+":")), 16, 64)
		if err != nil || v&(1<<21) != 0 {
			t.Fatalf("a process started through the agent has %q (CAP_SYS_ADMIN is bit 21)", line)
		}
	}
	orig := fmt.Sprint(time.Now().UnixNano())
	setMemory(t, svc, a.ID, map[string]string{"SECRET": orig})
	counter(t, svc, a.ID, orig)

	begin := time.Now()
	sn := mustSnapshot(t, svc, cubelet.SnapshotRequest{SandboxID: a.ID, SnapshotID: "gm-snap"})
	t.Logf("memory snapshot took %s", time.Since(begin))
	if !sn.HasMemory {
		t.Fatalf("snapshot %+v: want memory", sn)
	}
	mustState(t, svc, a.ID, lifecycle.Running)
	wantMemory(t, svc, a.ID, map[string]string{"SECRET": orig})
	holds(t, svc, a.ID, orig)

	// Change the original's memory: clones and rollback must get the
	// snapshot's value, not this one.
	setMemory(t, svc, a.ID, map[string]string{"SECRET": "changed"})

	t.Run("clone", func(t *testing.T) {
		begin := time.Now()
		res, err := svc.Clone(ctx, cubelet.CloneRequest{SnapshotID: sn.ID, Count: clones})
		if err != nil {
			t.Fatalf("clone: %v", err)
		}
		t.Logf("clone of %d took %s", clones, time.Since(begin))
		seen := map[string]bool{}
		var wg sync.WaitGroup
		for _, c := range res.Sandboxes {
			if seen[c.ID] || c.ID == a.ID {
				t.Fatalf("clone ID %s not distinct", c.ID)
			}
			seen[c.ID] = true
			mustState(t, svc, c.ID, lifecycle.Running)
			wantMemory(t, svc, c.ID, map[string]string{"SECRET": orig, "CUBE_SANDBOX_ID": c.ID})
			wg.Add(1)
			go func() {
				defer wg.Done()
				holds(t, svc, c.ID, orig)
			}()
			if got := shell(t, svc, c.ID, `echo $CUBE_SANDBOX_ID`); got != c.ID {
				t.Errorf("clone %s: new processes see CUBE_SANDBOX_ID=%q", c.ID, got)
			}
			if got := shell(t, svc, c.ID, `hostname`); got != c.ID {
				t.Errorf("clone %s: hostname %q, want its ID", c.ID, got)
			}
		}
		wg.Wait()
		for _, c := range res.Sandboxes {
			if _, err := svc.Delete(ctx, c.ID); err != nil {
				t.Fatal(err)
			}
		}
	})

	t.Run("rollback", func(t *testing.T) {
		if _, err := svc.Rollback(ctx, cubelet.RollbackRequest{SandboxID: a.ID, SnapshotID: sn.ID}); err != nil {
			t.Fatalf("rollback: %v", err)
		}
		mustState(t, svc, a.ID, lifecycle.Running)
		wantMemory(t, svc, a.ID, map[string]string{"SECRET": orig})
		holds(t, svc, a.ID, orig)
	})

	t.Run("snapshot of paused", func(t *testing.T) {
		if _, err := svc.Pause(ctx, a.ID); err != nil {
			t.Fatal(err)
		}
		s := mustSnapshot(t, svc, cubelet.SnapshotRequest{SandboxID: a.ID, SnapshotID: "gm-paused"})
		if !s.HasMemory {
			t.Fatalf("snapshot of paused sandbox has no memory")
		}
		mustState(t, svc, a.ID, lifecycle.Paused)
		if _, err := svc.Resume(ctx, a.ID); err != nil {
			t.Fatal(err)
		}
		holds(t, svc, a.ID, orig)
		if err := svc.DeleteSnapshot(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("refused with a user listener", func(t *testing.T) {
		shell(t, svc, a.ID, `(nc -l -p 8080 </dev/null >/dev/null 2>&1 &) ; sleep 0.3`)
		_, err := svc.Snapshot(ctx, cubelet.SnapshotRequest{SandboxID: a.ID, SnapshotID: "gm-never"})
		if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), ":8080") {
			t.Fatalf("snapshot with a listener = %v, want FailedPrecondition naming :8080", err)
		}
		mustState(t, svc, a.ID, lifecycle.Running)
		holds(t, svc, a.ID, orig)
		shell(t, svc, a.ID, `killall nc; sleep 0.2`)
	})

	t.Run("faults", func(t *testing.T) {
		for _, p := range points(svc, cubelet.FlowSnapshot) {
			inject(t, p, "1*error")
			if _, err := svc.Snapshot(ctx, cubelet.SnapshotRequest{SandboxID: a.ID, SnapshotID: "gm-never"}); !errors.Is(err, failpoint.ErrInjected) {
				t.Fatalf("%s: want injected error, got %v", p, err)
			}
			failpoint.Disable(p)
			mustState(t, svc, a.ID, lifecycle.Running)
			holds(t, svc, a.ID, orig)
		}
		for _, p := range []string{"clone/container/after", "clone/agent"} {
			inject(t, p, "1*error")
			if _, err := svc.Clone(ctx, cubelet.CloneRequest{SnapshotID: sn.ID, Count: 2}); !errors.Is(err, failpoint.ErrInjected) {
				t.Fatalf("%s: want injected error, got %v", p, err)
			}
			failpoint.Disable(p)
			if n := len(mustList(t, svc)); n != 1 {
				t.Fatalf("%s: %d sandboxes after a failed clone", p, n)
			}
		}
		if ids := listSnaps(t, svc, ""); len(ids) != 1 {
			t.Fatalf("snapshots after failed verbs: %v", ids)
		}
	})
}
