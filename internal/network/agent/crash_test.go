package agent_test

import (
	"context"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/leakcheck"
	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/client"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/network/policy"
)

// TestKillAnywhere SIGKILLs network-agent (a "kill" failpoint: the process
// kills itself at exactly that point) at every step of creating, assigning
// and releasing a slot, restarts it, and checks that reconcile leaves no
// namespace, link or rule behind and the slot store agrees.
func TestKillAnywhere(t *testing.T) {
	e := nettest.NewProcessEnv(t, nettest.Options{})
	type op int
	const (
		ensureContainer op = iota
		ensureVM
		release
	)
	cases := []struct {
		point string
		op    op
		pool  int
		// kept: the slot survives the restart (its record said Assigned)
		// and the test releases it.
		kept bool
		// debris: the crash leaves kernel objects for reconcile to remove
		// (else only a record).
		debris bool
	}{
		{point: "network/create/after-record", op: ensureContainer},
		{point: "slot/netns", op: ensureContainer},
		{point: "slot/sandbox-netns", op: ensureContainer, debris: true},
		{point: "slot/uplink", op: ensureContainer, debris: true},
		{point: "slot/uplink-addr", op: ensureContainer, debris: true},
		{point: "slot/sandbox-link", op: ensureContainer, debris: true},
		{point: "slot/rules", op: ensureContainer, debris: true},
		{point: "slot/tap", op: ensureVM, debris: true},
		{point: "slot/tap-addr", op: ensureVM, debris: true},
		{point: "network/assign/policy", op: ensureContainer, pool: 1, kept: true, debris: true},
		{point: "network/release/after-record", op: release, debris: true},
		{point: "slot/release/uplink", op: release, debris: true},
		{point: "slot/release/netns", op: release, debris: true},
	}
	for _, c := range cases {
		t.Run(c.point, func(t *testing.T) {
			e.Config.Pool.Size = c.pool
			fp := c.point + "=kill"
			if c.op == release {
				fp = "" // armed after the slot exists, below
			}
			p := e.StartProcess(t, fp)
			cl, err := client.Dial(e.Socket)
			if err != nil {
				t.Fatal(err)
			}
			defer cl.Close()
			rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			if c.pool > 0 {
				waitPoolRemote(t, cl, c.pool)
			}
			kind := network.Container
			if c.op == ensureVM {
				kind = network.VM
			}
			if c.op == release {
				if _, err := cl.Ensure(rctx, "victim", kind, policy.Policy{}); err != nil {
					t.Fatal(err)
				}
				p.Kill()
				p = e.StartProcess(t, c.point+"=kill")
				if _, err := cl.Release(rctx, "victim"); err == nil {
					t.Fatal("release survived its kill failpoint")
				}
			} else if _, err := cl.Ensure(rctx, "victim", kind, policy.Policy{}); err == nil {
				t.Fatal("ensure survived its kill failpoint")
			}
			if !p.Exited(10 * time.Second) {
				t.Fatalf("failpoint %s did not kill the agent\n%s", c.point, p.Output())
			}
			if got := slotDebris(t, e); (got > 0) != c.debris {
				t.Fatalf("crash left %d slot objects, want debris=%v", got, c.debris)
			}

			e.Restart(t, false)
			left := e.Agent.List(ctx)
			switch {
			case c.kept && (len(left) != 1 || left[0].SandboxID != "victim"):
				t.Fatalf("assigned slot not adopted: %+v", left)
			case !c.kept && len(left) != 0:
				t.Fatalf("half-made slot survived the restart: %+v", left)
			}
			if c.kept {
				if ok, err := e.Agent.Release(ctx, "victim"); !ok || err != nil {
					t.Fatalf("release adopted slot: %v %v", ok, err)
				}
			}
			if err := e.Agent.Purge(ctx); err != nil { // the pool, if any
				t.Fatal(err)
			}
			e.AssertNoLeaks(t)
			e.Stop(t)
		})
	}
}

// TestKillWhileFillingPool crashes the agent while its pool filler builds
// a slot in the background, with no request in flight.
func TestKillWhileFillingPool(t *testing.T) {
	e := nettest.NewProcessEnv(t, nettest.Options{PoolSize: 3})
	p := e.SpawnProcess(t, "slot/rules=kill")
	if !p.Exited(20 * time.Second) {
		t.Fatalf("the filler never hit its failpoint\n%s", p.Output())
	}
	if slotDebris(t, e) == 0 {
		t.Fatal("the crash left nothing to reconcile")
	}
	e.Restart(t, false)
	if got := e.Agent.List(ctx); len(got) != 0 {
		t.Fatalf("slots assigned: %+v", got)
	}
	if err := e.Agent.Purge(ctx); err != nil {
		t.Fatal(err)
	}
	e.AssertNoLeaks(t)
	e.Stop(t)
}

// slotDebris counts the slot objects (pins, links) the leak checker sees.
func slotDebris(t *testing.T, e *nettest.Env) int {
	t.Helper()
	leaks, err := leakcheck.Check(ctx, e.Scope())
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, l := range leaks {
		if l.Kind != leakcheck.KindNft {
			n++
		}
	}
	return n
}

func waitPoolRemote(t *testing.T, c *client.Client, n int) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		h, err := c.Health(ctx)
		if err == nil && int(h.PoolReady) >= n {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("pool of %d never filled", n)
}
