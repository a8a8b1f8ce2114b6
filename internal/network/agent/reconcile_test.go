package agent_test

import (
	"net/netip"
	"path/filepath"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/netnsdir"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/network/policy"
)

// TestRestartAdoptsRepairsAndSweeps: a restarted agent keeps assigned and
// pooled slots (and their policy), rebuilds pieces removed behind its
// back, and removes pins and links no record names.
func TestRestartAdoptsRepairsAndSweeps(t *testing.T) {
	e := nettest.Start(t, nettest.Options{PoolSize: 2})
	w := nettest.NewWorld(t)
	no := false
	locked := mustPolicy(t, policy.Spec{AllowInternet: &no, Allow: []string{cidr32(w.Addrs[0])}})
	a1 := ensure(t, e.Agent, "keep-1", network.Container, locked)
	a2 := ensure(t, e.Agent, "keep-2", network.Container, policy.Policy{})
	if err := e.Agent.WaitPool(ctx, network.Container, 2); err != nil {
		t.Fatal(err)
	}
	p1 := probe{t: t, ns: a1.NetNS, port: w.Port}
	p1.ok(w.Addrs[0])
	p1.blocked(w.Addrs[1])

	e.Restart(t, false)
	if got, err := e.Agent.Get(ctx, "keep-1"); err != nil || got.Slot != a1.Slot || !got.Policy.Equal(locked) {
		t.Fatalf("after restart: %+v %v", got, err)
	}
	if e.Agent.PoolReady(network.Container) != 2 {
		t.Fatalf("pool not adopted: %d ready", e.Agent.PoolReady(network.Container))
	}
	p1.ok(w.Addrs[0])
	p1.blocked(w.Addrs[1])

	// Behind the agent's back: keep-2 loses its host link (and so its
	// veth pair), keep-1 its rules; an orphan pin and an orphan link with
	// the agent's prefix appear.
	if l, err := netlink.LinkByName(a2.HostLink); err != nil {
		t.Fatal(err)
	} else if err := netlink.LinkDel(l); err != nil {
		t.Fatal(err)
	}
	if err := netnsdir.Do(a1.SlotNetNS, func() error {
		return netlink.LinkSetDown(must(netlink.LinkByName("gw0")))
	}); err != nil {
		t.Fatal(err)
	}
	orphanPin := filepath.Join(e.Config.NetnsDir(), e.Config.Prefix+"-1000")
	if err := netnsdir.Create(orphanPin); err != nil {
		t.Fatal(err)
	}
	orphanLink := e.Config.Prefix + "-1001"
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: orphanLink}, PeerName: orphanLink + "p"}); err != nil {
		t.Fatal(err)
	}
	for _, ns := range []string{a1.NetNS, a2.NetNS} {
		if _, err := nettest.Greet(ctx, ns, netip.AddrPortFrom(w.Addrs[0], uint16(w.Port)), blockedWait); err == nil {
			t.Fatalf("%s still reaches the world after the sabotage", ns)
		}
	}

	sum, err := e.Agent.Reconcile(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// keep-2 lost a piece (repaired); keep-1's link was only down, which
	// converging fixes without recreating anything (adopted, like the two
	// pooled slots).
	if sum.Repaired != 1 || sum.Orphans != 2 || sum.Adopted != 3 || len(sum.Errors) != 0 {
		t.Fatalf("reconcile: %+v", sum)
	}
	probe{t: t, ns: a2.NetNS, port: w.Port}.ok(w.Addrs[0])
	p1.ok(w.Addrs[0])
	p1.blocked(w.Addrs[1])
	if ok, _ := netnsdir.IsPinned(orphanPin); ok {
		t.Error("orphan pin survived")
	}
	if _, err := netlink.LinkByName(orphanLink); err == nil {
		t.Error("orphan link survived")
	}
	releaseAll(t, e.Agent)
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}
