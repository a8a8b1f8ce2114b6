package integration

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/agentclient"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/leakcheck"
	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/agent"
	"github.com/cubesandbox/cube/internal/network/netnsdir"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/network/nft"
	"github.com/cubesandbox/cube/internal/network/policy"
)

func netPolicy(t *testing.T, s policy.Spec) *policy.Policy {
	t.Helper()
	p, err := policy.Parse("network", s)
	if err != nil {
		t.Fatal(err)
	}
	return &p
}

// sbProbe connects from inside a sandbox's own network namespace (its
// init's), as a process in the sandbox would.
type sbProbe struct {
	t    *testing.T
	pid  int
	port int
}

func (p sbProbe) ns() string { return fmt.Sprintf("/proc/%d/ns/net", p.pid) }

func (p sbProbe) ok(a netip.Addr) {
	p.t.Helper()
	if _, err := nettest.Greet(context.Background(), p.ns(), netip.AddrPortFrom(a, uint16(p.port)), 5*time.Second); err != nil {
		p.t.Fatalf("sandbox → %s:%d should connect: %v", a, p.port, err)
	}
}

func (p sbProbe) blocked(a netip.Addr) {
	p.t.Helper()
	_, err := nettest.Greet(context.Background(), p.ns(), netip.AddrPortFrom(a, uint16(p.port)), 400*time.Millisecond)
	if err == nil || !nettest.IsTimeout(err) {
		p.t.Fatalf("sandbox → %s:%d should be dropped, got %v", a, p.port, err)
	}
}

func cidr(a netip.Addr) string { return netip.PrefixFrom(a, 32).String() }

// TestNetworkSandboxes runs sandboxes in network-agent slots: the runtime
// joins the slot, the host reaches the agent through the slot's host IP,
// the create request's policy holds, UpdateNetwork changes it live, resume
// re-applies it, neighbours are isolated, and destroy releases the slot.
func TestNetworkSandboxes(t *testing.T) {
	env := cubelettest.New(t, "")
	net := env.StartNetworkAgent(t, nettest.Options{PoolSize: 2})
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	w := nettest.NewWorld(t)
	ctx := context.Background()
	no := false

	res, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox",
		Network: netPolicy(t, policy.Spec{AllowInternet: &no, Allow: []string{cidr(w.Addrs[0])}})})
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	a := res.Sandbox
	cleanupDelete(t, svc, a.ID)
	if a.Network == nil || a.Network.HostIP == "" || a.Network.SandboxIP != "169.254.0.21" {
		t.Fatalf("no slot recorded: %+v", a.Network)
	}
	// The runtime joined the slot's sandbox namespace.
	want, _ := netnsdir.Inode(a.Network.NetNS)
	got, _ := netnsdir.Inode(fmt.Sprintf("/proc/%d/ns/net", a.Container.PID))
	if want == 0 || got != want {
		t.Fatalf("sandbox netns inode %d, slot's %d", got, want)
	}
	// Port exposure: the host reaches the agent on the slot's host IP.
	resp, err := http.Get(fmt.Sprintf("http://%s:%d/health", a.Network.HostIP, agentproto.Port))
	if err != nil || resp.StatusCode/100 != 2 {
		t.Fatalf("agent through host IP: %v %v", resp, err)
	}
	resp.Body.Close()
	if ok, conds := svc.Health(ctx); !ok || !hasCondition(conds, "network-agent") {
		t.Fatalf("health: %v %+v", ok, conds)
	}

	p := sbProbe{t: t, pid: a.Container.PID, port: w.Port}
	p.ok(w.Addrs[0])
	p.blocked(w.Addrs[1])

	t.Run("update network", func(t *testing.T) {
		rec, err := svc.UpdateNetwork(ctx, a.ID, *netPolicy(t, policy.Spec{Deny: []string{cidr(w.Addrs[1])}}))
		if err != nil {
			t.Fatal(err)
		}
		if rec.NetworkPolicy == nil || len(rec.NetworkPolicy.Deny) != 1 {
			t.Fatalf("record: %+v", rec.NetworkPolicy)
		}
		p.ok(w.Addrs[2])
		p.blocked(w.Addrs[1])
		if _, err := svc.UpdateNetwork(ctx, "nope", policy.Policy{}); !errdefs.IsNotFound(err) {
			t.Fatalf("unknown sandbox: %v", err)
		}
	})

	t.Run("resume re-applies the policy", func(t *testing.T) {
		if _, err := svc.Pause(ctx, a.ID); err != nil {
			t.Fatal(err)
		}
		// While it is paused its rules are lost (a flushed ruleset, a
		// botched upgrade): the slot is wide open...
		if err := netnsdir.Do(a.Network.SlotNetNS, func() error { return nft.DeleteTable(-1, nft.SlotTable) }); err != nil {
			t.Fatal(err)
		}
		// ...and resume puts the sandbox's own policy back before it runs.
		if _, err := svc.Resume(ctx, a.ID); err != nil {
			t.Fatal(err)
		}
		p.blocked(w.Addrs[1])
		p.ok(w.Addrs[2])
	})

	t.Run("neighbours are isolated", func(t *testing.T) {
		res, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox"})
		if err != nil {
			t.Fatal(err)
		}
		b := res.Sandbox
		defer func() {
			if _, err := svc.Delete(ctx, b.ID); err != nil {
				t.Error(err)
			}
		}()
		if b.Network.HostIP == a.Network.HostIP || b.Network.SandboxIP != a.Network.SandboxIP {
			t.Fatalf("addresses: a %+v b %+v", a.Network, b.Network)
		}
		// A cannot reach B's agent; the host can.
		sbProbe{t: t, pid: a.Container.PID, port: agentproto.Port}.blocked(netip.MustParseAddr(b.Network.HostIP))
		if err := agentclient.WaitAgentVia(ctx, b.Container.PID, b.Network.HostIP); err != nil {
			t.Fatal(err)
		}
		// B has the default policy: the internet, all of it.
		sbProbe{t: t, pid: b.Container.PID, port: w.Port}.ok(w.Addrs[1])
	})

	if _, err := svc.Delete(ctx, a.ID); err != nil {
		t.Fatal(err)
	}
	if left := net.Agent.List(ctx); len(left) != 0 {
		t.Fatalf("slots left after delete: %+v", left)
	}
}

// assertNoLeaksSoon is env.AssertNoLeaks allowing the kernel a moment: an
// auto-clearing loop device detaches asynchronously after its last
// unmount, so right after an undo it may still be listed (with its
// backing file already deleted). Anything still there after 3 s leaked.
func assertNoLeaksSoon(t *testing.T, env *cubelettest.Env) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for {
		leaks, err := leakcheck.Check(context.Background(), env.Scope())
		if err == nil && len(leaks) == 0 {
			return
		}
		if time.Now().After(deadline) {
			env.AssertNoLeaks(t)
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func hasCondition(conds []cubelet.Condition, typ string) bool {
	for _, c := range conds {
		if c.Type == typ {
			return c.OK
		}
	}
	return false
}

// TestNetworkFaults: a create failing at any action (before or after
// "net" did its work) releases the slot; a destroy whose release fails is
// journalled and finished by the cleanup loop; a cubelet restart releases
// slots of sandboxes it does not know.
func TestNetworkFaults(t *testing.T) {
	env := cubelettest.New(t, "")
	net := env.StartNetworkAgent(t, nettest.Options{})
	// Started by hand, not env.Start: the last subtest restarts it.
	svc, err := cubelet.New(context.Background(), env.Config, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { svc.Close() }()
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()

	for _, p := range points(svc, cubelet.FlowCreate) {
		if !strings.Contains(p, "/net") && !strings.Contains(p, "/container") {
			continue // the net action's own points and one after it
		}
		t.Run(p, func(t *testing.T) {
			inject(t, p, "1*error")
			_, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox"})
			if !errors.Is(err, failpoint.ErrInjected) {
				t.Fatalf("want injected error, got %v", err)
			}
			if l, _ := svc.List(ctx, cubelet.ListFilter{}); len(l) != 0 {
				t.Fatalf("failed create left records: %+v", l)
			}
			if l := net.Agent.List(ctx); len(l) != 0 {
				t.Fatalf("failed create left slots: %+v", l)
			}
			assertNoLeaksSoon(t, env)
			net.AssertNoSlots(t)
		})
	}

	t.Run("destroy/net", func(t *testing.T) {
		res, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox"})
		if err != nil {
			t.Fatal(err)
		}
		// The destroy fails, and so do Delete's brief retries (the
		// cleanup flow): the delete answers the error, and the
		// journalled cleanup finishes it.
		inject(t, "destroy/net", "1*error")
		inject(t, "cleanup/net", "5*error")
		if _, err := svc.Delete(ctx, res.Sandbox.ID); !errors.Is(err, failpoint.ErrInjected) {
			t.Fatalf("delete: %v", err)
		}
		deadline := time.Now().Add(20 * time.Second)
		for {
			_, err := svc.Get(ctx, res.Sandbox.ID)
			if errdefs.IsNotFound(err) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("the cleanup loop never finished the destroy")
			}
			time.Sleep(50 * time.Millisecond)
		}
		if l := net.Agent.List(ctx); len(l) != 0 {
			t.Fatalf("slot left: %+v", l)
		}
	})

	t.Run("restart releases unknown slots", func(t *testing.T) {
		if _, _, err := net.Agent.Ensure(ctx, agent.EnsureRequest{SandboxID: "ghost", Kind: network.Container}); err != nil {
			t.Fatal(err)
		}
		svc.Close()
		if svc, err = cubelet.New(ctx, env.Config, nil); err != nil {
			t.Fatal(err)
		}
		if _, err := net.Agent.Get(ctx, "ghost"); !errdefs.IsNotFound(err) {
			t.Fatalf("orphan slot kept: %v", err)
		}
	})
}

// TestNoNetworkAgent: without network-agent the net action does nothing,
// a restrictive policy is refused (it could not be enforced), and a
// sandbox has no network to update.
func TestNoNetworkAgent(t *testing.T) {
	env := cubelettest.New(t, "")
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()
	no := false
	_, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox", Network: netPolicy(t, policy.Spec{AllowInternet: &no})})
	if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "network-agent") {
		t.Fatalf("restrictive policy without an agent: %v", err)
	}
	res, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox", Network: &policy.Policy{}})
	if err != nil {
		t.Fatal(err)
	}
	cleanupDelete(t, svc, res.Sandbox.ID)
	if res.Sandbox.Network != nil {
		t.Fatalf("slot without an agent: %+v", res.Sandbox.Network)
	}
	if _, err := svc.UpdateNetwork(ctx, res.Sandbox.ID, policy.Policy{}); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("update without a slot: %v", err)
	}
	if ok, conds := svc.Health(ctx); !ok || hasCondition(conds, "network-agent") {
		t.Fatalf("health: %v %+v", ok, conds)
	}
}
