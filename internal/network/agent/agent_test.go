package agent_test

import (
	"context"
	"net/netip"
	"os"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/agent"
	"github.com/cubesandbox/cube/internal/network/netnsdir"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/network/policy"
)

var ctx = context.Background()

func mustPolicy(t *testing.T, s policy.Spec) policy.Policy {
	t.Helper()
	p, err := policy.Parse("", s)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func ensure(t *testing.T, a *agent.Agent, id string, kind network.Kind, p policy.Policy) *network.Network {
	t.Helper()
	n, created, err := a.Ensure(ctx, agent.EnsureRequest{SandboxID: id, Kind: kind, Policy: p})
	if err != nil {
		t.Fatalf("ensure %s: %v", id, err)
	}
	if !created {
		t.Fatalf("ensure %s: not created", id)
	}
	return n
}

// linkAddrs lists the IPv4 addresses of a link in the namespace pinned at
// nsPath ("" = the host).
func linkAddrs(t *testing.T, nsPath, link string) []string {
	t.Helper()
	h := &netlink.Handle{}
	if nsPath != "" {
		ns, err := netns.GetFromPath(nsPath)
		if err != nil {
			t.Fatal(err)
		}
		defer ns.Close()
		if h, err = netlink.NewHandleAt(ns); err != nil {
			t.Fatal(err)
		}
		defer h.Close()
	}
	l, err := h.LinkByName(link)
	if err != nil {
		t.Fatalf("link %s in %q: %v", link, nsPath, err)
	}
	as, err := h.AddrList(l, netlink.FAMILY_V4)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, a := range as {
		out = append(out, a.IPNet.String())
	}
	return out
}

func TestEnsureIdempotentAndRelease(t *testing.T) {
	e := nettest.Start(t, nettest.Options{})
	a := e.Agent
	n := ensure(t, a, "sb1", network.Container, policy.Policy{})
	if n.SandboxIP != "169.254.0.21" || n.FromPool || n.Tap != "" {
		t.Errorf("network: %+v", n)
	}
	cidr := e.Config.CIDR()
	host, gw := netip.MustParseAddr(n.HostIP), netip.MustParseAddr(n.GatewayIP)
	if !cidr.Contains(host) || !cidr.Contains(gw) || host == gw {
		t.Errorf("addresses %s/%s outside %s", host, gw, cidr)
	}
	if got := linkAddrs(t, "", n.HostLink); len(got) != 1 || got[0] != gw.String()+"/30" {
		t.Errorf("host link addresses %v", got)
	}
	if got := linkAddrs(t, n.NetNS, "eth0"); len(got) != 1 || got[0] != "169.254.0.21/30" {
		t.Errorf("sandbox eth0 %v", got)
	}
	if got := linkAddrs(t, n.SlotNetNS, "up0"); len(got) != 1 || got[0] != host.String()+"/30" {
		t.Errorf("slot up0 %v", got)
	}

	// Same parameters: the same slot.
	again, created, err := a.Ensure(ctx, agent.EnsureRequest{SandboxID: "sb1", Kind: network.Container})
	if err != nil || created || again.Slot != n.Slot || again.HostIP != n.HostIP {
		t.Fatalf("second ensure: %+v created=%v %v", again, created, err)
	}
	// Different parameters: a clear error, the slot untouched.
	no := false
	_, _, err = a.Ensure(ctx, agent.EnsureRequest{SandboxID: "sb1", Kind: network.Container, Policy: policy.Policy{AllowInternet: &no}})
	if !errdefs.IsAlreadyExists(err) {
		t.Fatalf("ensure with another policy: %v", err)
	}
	_, _, err = a.Ensure(ctx, agent.EnsureRequest{SandboxID: "sb1", Kind: network.VM})
	if !errdefs.IsAlreadyExists(err) {
		t.Fatalf("ensure with another kind: %v", err)
	}
	if got, err := a.Get(ctx, "sb1"); err != nil || got.Slot != n.Slot {
		t.Fatalf("get: %v %v", got, err)
	}
	if l := a.List(ctx); len(l) != 1 || l[0].SandboxID != "sb1" {
		t.Fatalf("list: %v", l)
	}

	if ok, err := a.Release(ctx, "sb1"); !ok || err != nil {
		t.Fatalf("release: %v %v", ok, err)
	}
	if ok, err := a.Release(ctx, "sb1"); ok || err != nil {
		t.Fatalf("second release: %v %v", ok, err)
	}
	if _, err := a.Get(ctx, "sb1"); !errdefs.IsNotFound(err) {
		t.Fatalf("get released: %v", err)
	}
	if _, err := a.UpdatePolicy(ctx, "sb1", nil); !errdefs.IsNotFound(err) {
		t.Fatalf("update released: %v", err)
	}
	if ok, _ := netnsdir.IsPinned(n.SlotNetNS); ok {
		t.Error("slot namespace still pinned")
	}
	e.AssertNoSlots(t)
}

func TestVMSlot(t *testing.T) {
	e := nettest.Start(t, nettest.Options{})
	n := ensure(t, e.Agent, "vm1", network.VM, policy.Policy{})
	if n.Tap != "tap0" || n.NetNS != n.SlotNetNS {
		t.Fatalf("vm network: %+v", n)
	}
	if got := linkAddrs(t, n.SlotNetNS, "tap0"); len(got) != 1 || got[0] != "169.254.0.22/30" {
		t.Errorf("tap0 %v", got)
	}
	if _, err := os.Stat(n.SlotNetNS + "-sb"); err == nil {
		t.Error("a VM slot has a sandbox namespace")
	}
	if _, err := e.Agent.Release(ctx, "vm1"); err != nil {
		t.Fatal(err)
	}
}
