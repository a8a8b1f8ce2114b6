package agent_test

import (
	"net/netip"
	"testing"

	"github.com/google/nftables"

	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/netnsdir"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/network/nft"
	"github.com/cubesandbox/cube/internal/network/policy"
)

// TestSlotOutput: a VM's monitor runs in its slot namespace, so a monitor
// compromised from the guest sends from there, past the forward chain
// that holds the guest's policy. The slot table's output chain lets the
// namespace itself open connections only to its sandbox (what cubelet
// does to reach a guest's agent) and on loopback. The probes dial, from a
// VM slot's namespace, the internet, a private address and the metadata
// service; control: with the output chain deleted the same dials answer.
func TestSlotOutput(t *testing.T) {
	e := nettest.Start(t, nettest.Options{OpenPrivate: []string{nettest.PrivateRange}})
	a := e.Agent
	w := nettest.NewWorld(t)
	meta := w.ServeMetadata(t)
	vm := ensure(t, a, "sb-vmout", network.VM, policy.Policy{})
	ct := ensure(t, a, "sb-ctout", network.Container, policy.Policy{})
	defer func() {
		for _, id := range []string{"sb-vmout", "sb-ctout"} {
			if _, err := a.Release(ctx, id); err != nil {
				t.Error(err)
			}
		}
	}()
	targets := []netip.Addr{w.Addrs[0], w.Private, meta}

	p := probe{t: t, ns: vm.SlotNetNS, port: w.Port}
	p.blocked(targets...)
	t.Logf("VM slot namespace → %v: dropped by the slot's output chain", targets)

	// What the namespace may do: reach its sandbox (cubelet entering a
	// VM's namespace to dial the guest's agent; a container slot stands
	// in for the guest here) and loopback.
	nettest.ServeIn(t, ct.NetNS, w.Port)
	probe{t: t, ns: ct.SlotNetNS, port: w.Port}.ok(network.SandboxIP)
	nettest.ServeIn(t, vm.SlotNetNS, w.Port+1)
	probe{t: t, ns: vm.SlotNetNS, port: w.Port + 1}.ok(netip.MustParseAddr("127.0.0.1"))

	// Control: the same dials without the output chain.
	if err := netnsdir.Do(vm.SlotNetNS, func() error {
		c, err := nftables.New()
		if err != nil {
			return err
		}
		c.DelChain(&nftables.Chain{Name: "output", Table: &nftables.Table{Family: nftables.TableFamilyIPv4, Name: nft.SlotTable}})
		return c.Flush()
	}); err != nil {
		t.Fatal(err)
	}
	for _, addr := range targets {
		p.ok(addr)
	}
	t.Logf("control: without the output chain the VM slot namespace reaches %v", targets)
}
