package agent_test

import (
	"fmt"
	"os"
	"net/netip"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/network/nft"
	"github.com/cubesandbox/cube/internal/network/policy"
	"github.com/cubesandbox/cube/internal/network/slot"
)

func TestTmpBreakdown(t *testing.T) {
	e := nettest.Start(t, nettest.Options{PoolSize: 0})
	n := ensure(t, e.Agent, "x1", network.Container, policy.Policy{})
	f, _ := os.Open(n.SlotNetNS)
	defer f.Close()
	var l slot.Layout
	_ = l
	rules := nft.Slot{Uplink: "up0", Gateway: mustAddr(n.GatewayIP), HostIP: mustAddr(n.HostIP), SandboxIP: mustAddr(n.SandboxIP), NodeCIDR: e.Config.CIDR()}
	for i := 0; i < 5; i++ {
		t0 := time.Now()
		if err := nft.ApplySlot(int(f.Fd()), rules); err != nil {
			t.Fatal(err)
		}
		fmt.Println("apply", time.Since(t0))
	}
	for i := 0; i < 5; i++ {
		t0 := time.Now()
		p := policy.Policy{}
		if _, err := e.Agent.UpdatePolicy(ctx, "x1", &p); err != nil {
			t.Fatal(err)
		}
		fmt.Println("update", time.Since(t0))
	}
	t0 := time.Now()
	e.Agent.Release(ctx, "x1")
	fmt.Println("release", time.Since(t0))
}

func mustAddr(s string) netip.Addr { return netip.MustParseAddr(s) }
