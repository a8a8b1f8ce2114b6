package agent_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/agent"
	"github.com/cubesandbox/cube/internal/network/client"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/network/policy"
)

// TestFailuresUndo: an Ensure that fails at any step (every failpoint a
// slot create, assign or release passes, found by tracking) leaves no
// slot, record or kernel object behind; a Release that fails keeps the
// slot for a retry, which then succeeds.
func TestFailuresUndo(t *testing.T) {
	e := nettest.Start(t, nettest.Options{})
	a := e.Agent

	// Discover every point a cold container and VM ensure and a release pass.
	failpoint.Track()
	ensure(t, a, "probe", network.Container, policy.Policy{})
	ensure(t, a, "probe-vm", network.VM, policy.Policy{})
	releaseAll(t, a)
	points := failpoint.Names()
	failpoint.Reset()
	var create, release []string
	for _, p := range points {
		if strings.Contains(p, "release") {
			release = append(release, p)
		} else if strings.HasPrefix(p, "slot/") || strings.HasPrefix(p, "network/create") {
			create = append(create, p)
		}
	}
	if len(create) < 8 || len(release) < 3 {
		t.Fatalf("too few failpoints found: create %v release %v", create, release)
	}

	for _, p := range create {
		t.Run(p, func(t *testing.T) {
			defer failpoint.Reset()
			if err := failpoint.Enable(p, "error"); err != nil {
				t.Fatal(err)
			}
			kind := network.Container
			if strings.Contains(p, "tap") {
				kind = network.VM
			}
			_, _, err := a.Ensure(ctx, agent.EnsureRequest{SandboxID: "fails", Kind: kind})
			if !errors.Is(err, failpoint.ErrInjected) {
				t.Fatalf("ensure: %v", err)
			}
			if l := a.List(ctx); len(l) != 0 {
				t.Fatalf("slot kept after a failed ensure: %+v", l)
			}
			e.AssertNoSlots(t)
		})
	}
	for _, p := range release {
		t.Run(p, func(t *testing.T) {
			defer failpoint.Reset()
			ensure(t, a, "rel", network.Container, policy.Policy{})
			if err := failpoint.Enable(p, "1*error"); err != nil {
				t.Fatal(err)
			}
			if _, err := a.Release(ctx, "rel"); !errors.Is(err, failpoint.ErrInjected) {
				t.Fatalf("release: %v", err)
			}
			if _, err := a.Get(ctx, "rel"); err != nil {
				t.Fatalf("a failed release forgot the slot: %v", err)
			}
			if _, _, err := a.Ensure(ctx, agent.EnsureRequest{SandboxID: "rel"}); !errdefs.IsFailedPrecondition(err) {
				t.Fatalf("ensure of a half-released slot: %v", err)
			}
			if ok, err := a.Release(ctx, "rel"); !ok || err != nil {
				t.Fatalf("retry: %v %v", ok, err)
			}
			e.AssertNoSlots(t)
		})
	}
}

// TestAssignFailureUndo: a pooled slot whose policy cannot be applied is
// released, neither handed out nor returned to the pool, and the sandbox
// gets a slot built for it instead.
func TestAssignFailureUndo(t *testing.T) {
	e := nettest.Start(t, nettest.Options{PoolSize: 1, RefillPerSecond: 1})
	if err := e.Agent.WaitPool(ctx, network.Container, 1); err != nil {
		t.Fatal(err)
	}
	pooled := e.Agent.PoolReady(network.Container)
	defer failpoint.Reset()
	if err := failpoint.Enable("network/assign/policy", "1*error"); err != nil {
		t.Fatal(err)
	}
	n, _, err := e.Agent.Ensure(ctx, agent.EnsureRequest{SandboxID: "a1"})
	if err != nil || n.FromPool {
		t.Fatalf("ensure: %+v %v", n, err)
	}
	if l := e.Agent.List(ctx); len(l) != 1 || e.Agent.PoolReady(network.Container) != 0 || pooled != 1 {
		t.Fatalf("after failed assign: %v, %d pooled", l, e.Agent.PoolReady(network.Container))
	}
	if n.Slot == 0 {
		t.Fatal("the broken pooled slot (0) was handed out")
	}
	releaseAll(t, e.Agent)
}

// TestReleaseBuildIgnoresFailpoints: a network-agent built as releases
// are (no failpoints tag) ignores CUBE_FAILPOINTS, kill included: with a
// kill at the first step of creating a slot and a pool to fill, it says
// so in its log, fills the pool and keeps running. Control: the test
// build (-tags failpoints) with the same environment kills itself there.
func TestReleaseBuildIgnoresFailpoints(t *testing.T) {
	e := nettest.NewProcessEnv(t, nettest.Options{})
	e.Config.Pool.Size = 1
	const fp = "slot/netns=kill"

	p := e.SpawnBinary(t, nettest.ReleaseBinary(t), fp)
	e.WaitHealthy(t, p)
	c, err := client.Dial(e.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	deadline := time.Now().Add(30 * time.Second)
	for {
		h, err := c.Health(ctx)
		if err == nil && h.PoolReady >= 1 {
			break
		}
		if p.Exited(0) {
			t.Fatalf("the release build exited with CUBE_FAILPOINTS=%s:\n%s", fp, p.Output())
		}
		if time.Now().After(deadline) {
			t.Fatalf("the release build's pool never filled (%v, %v):\n%s", h, err, p.Output())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if p.Exited(500 * time.Millisecond) {
		t.Fatalf("the release build exited after filling its pool:\n%s", p.Output())
	}
	if !strings.Contains(p.Output(), "CUBE_FAILPOINTS ignored") {
		t.Fatalf("the release build did not log that it ignores CUBE_FAILPOINTS:\n%s", p.Output())
	}
	t.Logf("release build: passed slot/netns (a pooled slot is ready) and runs on; it logged that CUBE_FAILPOINTS is ignored")
	p.Kill()

	ctl := e.SpawnProcess(t, fp)
	if !ctl.Exited(30 * time.Second) {
		t.Fatalf("control: the failpoints build with CUBE_FAILPOINTS=%s kept running:\n%s", fp, ctl.Output())
	}
	if err := ctl.Err(); err == nil || !strings.Contains(err.Error(), "signal: killed") {
		t.Fatalf("control: the failpoints build ended with %v, want SIGKILL (the failpoint):\n%s", err, ctl.Output())
	}
	t.Log("control: the failpoints build killed itself at slot/netns")
}
