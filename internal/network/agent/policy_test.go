package agent_test

import (
	"context"
	"errors"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/agent"
	"github.com/cubesandbox/cube/internal/network/netnsdir"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/network/nft"
	"github.com/cubesandbox/cube/internal/network/policy"
)

// blockedWait is how long a probe waits before calling a destination
// blocked: dropped packets never answer. Allowed ones answer in
// milliseconds, even on a loaded machine.
const blockedWait = 400 * time.Millisecond

type probe struct {
	t    *testing.T
	ns   string
	port int
}

func (p probe) ok(a netip.Addr) {
	p.t.Helper()
	line, err := nettest.Greet(ctx, p.ns, netip.AddrPortFrom(a, uint16(p.port)), 5*time.Second)
	if err != nil {
		p.t.Fatalf("%s should be reachable: %v", a, err)
	}
	if !strings.Contains(line, "hello") {
		p.t.Fatalf("%s answered %q", a, line)
	}
}

func (p probe) blocked(addrs ...netip.Addr) {
	p.t.Helper()
	var wg sync.WaitGroup
	errs := make([]error, len(addrs))
	for i, a := range addrs {
		wg.Go(func() {
			_, errs[i] = nettest.Greet(ctx, p.ns, netip.AddrPortFrom(a, uint16(p.port)), blockedWait)
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err == nil {
			p.t.Errorf("%s should be blocked but answered", addrs[i])
		} else if !nettest.IsTimeout(err) {
			p.t.Errorf("%s should be dropped (timeout), got %v", addrs[i], err)
		}
	}
	if p.t.Failed() {
		p.t.FailNow()
	}
}

func update(t *testing.T, a *agent.Agent, id string, s policy.Spec) {
	t.Helper()
	p := mustPolicy(t, s)
	if _, err := a.UpdatePolicy(ctx, id, &p); err != nil {
		t.Fatalf("update policy: %v", err)
	}
}

func cidr32(a netip.Addr) string { return netip.PrefixFrom(a, 32).String() }

// TestPolicy drives one sandbox through the policies of the issue against
// a world namespace, a neighbour sandbox and services on the host.
func TestPolicy(t *testing.T) {
	e := nettest.Start(t, nettest.Options{OpenPrivate: []string{nettest.PrivateRange}})
	a := e.Agent
	w := nettest.NewWorld(t)
	sb := ensure(t, a, "sb-a", network.Container, policy.Policy{})
	nb := ensure(t, a, "sb-b", network.Container, policy.Policy{})
	defer func() {
		for _, id := range []string{"sb-a", "sb-b"} {
			if _, err := a.Release(ctx, id); err != nil {
				t.Error(err)
			}
		}
	}()
	p := probe{t: t, ns: sb.NetNS, port: w.Port}
	no, yes := false, true

	// Default: the internet answers, and every one of its addresses.
	p.ok(w.Addrs[0])
	p.ok(w.Addrs[1])

	t.Run("private ranges and metadata are unreachable by default", func(t *testing.T) {
		p := probe{t: t, ns: sb.NetNS, port: w.Port}
		p.blocked(w.Private, w.Closed, netip.MustParseAddr("169.254.169.254"))
	})

	t.Run("host services and the neighbour are unreachable", func(t *testing.T) {
		hostPort := w.Port + 1
		nettest.ServeIn(t, "", hostPort)       // a service on the host, all addresses
		nettest.ServeIn(t, nb.NetNS, hostPort) // a service in the neighbour
		hp := probe{t: t, ns: sb.NetNS, port: hostPort}
		hp.blocked(netip.MustParseAddr(sb.GatewayIP), w.HostEnd, netip.MustParseAddr(nb.HostIP), netip.MustParseAddr(nb.GatewayIP))
		// Even an allow list naming them opens nothing (the node CIDR is
		// private: naming it is refused outright, see below).
		update(t, a, "sb-a", policy.Spec{Allow: []string{cidr32(w.HostEnd)}})
		hp.blocked(netip.MustParseAddr(nb.HostIP), netip.MustParseAddr(sb.GatewayIP), w.HostEnd)
		// The host itself reaches the neighbour's port through its host IP
		// (port exposure), and what it sees is the neighbour.
		line, err := nettest.Greet(ctx, "", netip.AddrPortFrom(netip.MustParseAddr(nb.HostIP), uint16(hostPort)), 5*time.Second)
		if err != nil || !strings.Contains(line, "169.254.0.21") {
			t.Fatalf("host → neighbour host IP: %q %v", line, err)
		}
		// Nothing is exposed beyond the host: the world (routed through the
		// host, like any other machine) cannot open a connection to a slot.
		wp := probe{t: t, ns: w.NS, port: hostPort}
		wp.blocked(netip.MustParseAddr(nb.HostIP))
	})

	t.Run("internet off: nothing leaves", func(t *testing.T) {
		update(t, a, "sb-a", policy.Spec{AllowInternet: &no})
		probe{t: t, ns: sb.NetNS, port: w.Port}.blocked(w.Addrs[0], w.Addrs[1], w.Addrs[2], w.Private)
	})

	t.Run("allow list: only listed CIDRs answer", func(t *testing.T) {
		update(t, a, "sb-a", policy.Spec{AllowInternet: &no, Allow: []string{cidr32(w.Addrs[1]), cidr32(w.Private)}})
		p := probe{t: t, ns: sb.NetNS, port: w.Port}
		p.ok(w.Addrs[1])
		p.ok(w.Private)
		p.blocked(w.Addrs[0], w.Addrs[2])
	})

	t.Run("a private range the operator did not open stays closed", func(t *testing.T) {
		// Allowing everything opens the range the operator opened (the
		// control: the same kind of address over the same path answers)
		// and nothing of the one it did not.
		update(t, a, "sb-a", policy.Spec{Allow: []string{"0.0.0.0/0"}})
		p := probe{t: t, ns: sb.NetNS, port: w.Port}
		p.ok(w.Private)
		p.blocked(w.Closed)
		// Naming the closed range is refused, not silently ignored.
		pol := mustPolicy(t, policy.Spec{Allow: []string{cidr32(w.Closed)}})
		_, err := a.UpdatePolicy(ctx, "sb-a", &pol)
		var fe *errdefs.FieldError
		if !errors.As(err, &fe) || fe.Field != "policy.allow_out" || !strings.Contains(fe.Msg, "open_private") {
			t.Fatalf("allow_out of a closed private address: %v, want a field error naming open_private", err)
		}
		if _, _, err := a.Ensure(ctx, agent.EnsureRequest{SandboxID: "sb-closed", Kind: network.Container, Policy: pol}); !errdefs.IsInvalidArgument(err) {
			t.Fatalf("ensure with a closed private address: %v, want invalid argument", err)
		}
	})

	t.Run("deny beats the default allow", func(t *testing.T) {
		update(t, a, "sb-a", policy.Spec{AllowInternet: &yes, Deny: []string{cidr32(w.Addrs[2])}})
		p := probe{t: t, ns: sb.NetNS, port: w.Port}
		p.ok(w.Addrs[0])
		p.blocked(w.Addrs[2])
	})

	t.Run("allow wins over deny", func(t *testing.T) {
		update(t, a, "sb-a", policy.Spec{Deny: []string{"198.51.100.0/24"}, Allow: []string{cidr32(w.Addrs[0])}})
		p := probe{t: t, ns: sb.NetNS, port: w.Port}
		p.ok(w.Addrs[0])
		p.blocked(w.Addrs[1])
	})

	t.Run("update takes effect on a live connection attempt", func(t *testing.T) {
		update(t, a, "sb-a", policy.Spec{AllowInternet: &no})
		got := make(chan error, 1)
		attemptCtx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		go func() {
			// A client retrying, as a sandbox's would.
			for {
				_, err := nettest.Greet(attemptCtx, sb.NetNS, netip.AddrPortFrom(w.Addrs[0], uint16(w.Port)), 200*time.Millisecond)
				if err == nil || attemptCtx.Err() != nil {
					got <- err
					return
				}
			}
		}()
		time.Sleep(500 * time.Millisecond) // a few refused attempts
		select {
		case err := <-got:
			t.Fatalf("connected while the internet was off: %v", err)
		default:
		}
		update(t, a, "sb-a", policy.Spec{AllowInternet: &yes})
		if err := <-got; err != nil {
			t.Fatalf("still blocked after the update: %v", err)
		}
	})

	t.Run("an open connection is cut when its destination is denied", func(t *testing.T) {
		update(t, a, "sb-a", policy.Spec{})
		c, err := nettest.Open(ctx, sb.NetNS, netip.AddrPortFrom(w.Addrs[0], uint16(w.Port)))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if err := c.Echo("before", 5*time.Second); err != nil {
			t.Fatal(err)
		}
		update(t, a, "sb-a", policy.Spec{Deny: []string{cidr32(w.Addrs[0])}})
		if err := c.Echo("after", blockedWait); err == nil {
			t.Fatal("denied connection still carries data")
		}
		// Allowed connections are picked up again after an update.
		c2, err := nettest.Open(ctx, sb.NetNS, netip.AddrPortFrom(w.Addrs[1], uint16(w.Port)))
		if err != nil {
			t.Fatal(err)
		}
		defer c2.Close()
		update(t, a, "sb-a", policy.Spec{Deny: []string{cidr32(w.Addrs[0]), cidr32(w.Addrs[2])}})
		if err := c2.Echo("still allowed", 5*time.Second); err != nil {
			t.Fatalf("allowed connection broken by an update: %v", err)
		}
	})

	t.Run("connection limit", func(t *testing.T) {
		update(t, a, "sb-a", policy.Spec{MaxConnections: 2})
		var conns []*nettest.Conn
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		for i := 0; i < 2; i++ {
			c, err := nettest.Open(ctx, sb.NetNS, netip.AddrPortFrom(w.Addrs[i], uint16(w.Port)))
			if err != nil {
				t.Fatalf("connection %d under the limit: %v", i, err)
			}
			conns = append(conns, c)
		}
		probe{t: t, ns: sb.NetNS, port: w.Port}.blocked(w.Addrs[2])
	})

	t.Run("a clone's new slot enforces its source's policy", func(t *testing.T) {
		// What cubelet's clone flow does: the net action ensures a slot for
		// the new sandbox with the policy its record carries (copied from
		// the source), before the clone's container starts.
		src := mustPolicy(t, policy.Spec{AllowInternet: &no, Allow: []string{cidr32(w.Addrs[2])}})
		update(t, a, "sb-a", policy.Spec{AllowInternet: &no, Allow: []string{cidr32(w.Addrs[2])}})
		clone := ensure(t, a, "sb-a-clone", network.Container, src)
		defer func() {
			if _, err := a.Release(ctx, "sb-a-clone"); err != nil {
				t.Errorf("release the clone: %v", err)
			}
		}()
		for _, ns := range []string{sb.NetNS, clone.NetNS} {
			p := probe{t: t, ns: ns, port: w.Port}
			p.ok(w.Addrs[2])
			p.blocked(w.Addrs[0], w.Addrs[1])
		}
	})

	t.Run("bandwidth limit", func(t *testing.T) {
		// The kernel's bucket holds one second of the rate plus the burst
		// (128 KiB), so the transfer must be well over that.
		const size = 1280 << 10
		measure := func() time.Duration {
			c, err := nettest.Open(ctx, sb.NetNS, netip.AddrPortFrom(w.Addrs[0], uint16(w.Port)))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			d, err := c.Transfer(size, 20*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			return d
		}
		update(t, a, "sb-a", policy.Spec{})
		free := measure()
		update(t, a, "sb-a", policy.Spec{EgressKbps: 4000}) // 500 kB/s
		limited := measure()
		t.Logf("1.25 MiB out: %v unlimited, %v at 4000 kbps", free, limited)
		if limited < 900*time.Millisecond || free > limited/2 {
			t.Fatalf("egress limit not enforced: %v unlimited, %v limited", free, limited)
		}
	})

	t.Run("re-apply restores tampered rules", func(t *testing.T) {
		update(t, a, "sb-a", policy.Spec{AllowInternet: &no})
		// Someone deletes the slot's table: the sandbox is wide open...
		err := netnsdir.Do(sb.SlotNetNS, func() error { return nft.DeleteTable(-1, nft.SlotTable) })
		if err != nil {
			t.Fatal(err)
		}
		// ...until the stored policy is re-applied (what resume does).
		if _, err := a.UpdatePolicy(ctx, "sb-a", nil); err != nil {
			t.Fatal(err)
		}
		probe{t: t, ns: sb.NetNS, port: w.Port}.blocked(w.Addrs[0])
	})
}
