package agent_test

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/netnsdir"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/network/nft"
	"github.com/cubesandbox/cube/internal/network/policy"
	"github.com/cubesandbox/cube/internal/network/slot"
)

// TestNoIPv6: slots are IPv4 only. Their namespaces have IPv6 disabled,
// and two ip6 tables hold if it ever comes on: the slot's own (drops
// everything the slot namespace receives, forwards or sends) and the
// host's (drops whatever comes from a slot link). Each is shown with an
// IPv6 path opened on purpose (IPv6 enabled, link-local addresses up):
// the echo request is dropped with the table, answered without it.
func TestNoIPv6(t *testing.T) {
	e := nettest.Start(t, nettest.Options{})
	a := e.Agent
	sb := ensure(t, a, "sb-v6", network.Container, policy.Policy{})
	defer func() {
		if _, err := a.Release(ctx, "sb-v6"); err != nil {
			t.Error(err)
		}
	}()
	hostLink := e.Config.Prefix + "-" + strconv.Itoa(sb.Slot)

	// As the agent leaves them: no IPv6 on either side of the sandbox.
	for _, ns := range []string{sb.NetNS, sb.SlotNetNS} {
		if v := sysctl(t, ns, "ipv6/conf/all/disable_ipv6"); v != "1" {
			t.Fatalf("%s: disable_ipv6 = %q, want 1", ns, v)
		}
	}
	for _, has := range []func(int, string) (bool, error){nft.HasTable6} {
		if ok, err := inNS(sb.SlotNetNS, func() (bool, error) { return has(-1, nft.SlotTable) }); !ok || err != nil {
			t.Fatalf("slot has no ip6 table: %v", err)
		}
	}
	if ok, err := nft.HasTable6(-1, e.Config.Prefix); !ok || err != nil {
		t.Fatalf("host has no ip6 table %s: %v", e.Config.Prefix, err)
	}
	if _, err := ping6(sb.NetNS, "eth0", netip.MustParseAddr("ff02::1"), blockedWait); err == nil {
		t.Fatal("the sandbox sent an IPv6 echo with IPv6 disabled")
	} else {
		t.Logf("sandbox with IPv6 disabled: %v", err)
	}

	// Open the path: IPv6 on in the sandbox and slot namespaces.
	on := []string{"ipv6/conf/all/accept_dad", "0", "ipv6/conf/default/accept_dad", "0",
		"ipv6/conf/all/disable_ipv6", "0", "ipv6/conf/default/disable_ipv6", "0"}
	for _, ns := range []string{sb.NetNS, sb.SlotNetNS} {
		if err := netnsdir.Sysctl(ns, on...); err != nil {
			t.Fatal(err)
		}
	}
	if err := netnsdir.Sysctl(sb.NetNS, "ipv6/conf/"+slot.SandboxLink+"/accept_dad", "0"); err != nil {
		t.Fatal(err)
	}
	for _, l := range []string{slot.GatewayLink, slot.Uplink} {
		if err := netnsdir.Sysctl(sb.SlotNetNS, "ipv6/conf/"+l+"/accept_dad", "0"); err != nil {
			t.Fatal(err)
		}
	}
	gw := linkLocal(t, sb.SlotNetNS, slot.GatewayLink)
	linkLocal(t, sb.NetNS, slot.SandboxLink)

	t.Run("slot table", func(t *testing.T) {
		if from, err := ping6(sb.NetNS, slot.SandboxLink, gw, blockedWait); !errors.Is(err, errNoAnswer) {
			t.Fatalf("sandbox → slot %s over IPv6: want a dropped echo, got answer %v, error %v", gw, from, err)
		}
		t.Logf("sandbox → slot %s over IPv6: dropped by the slot's ip6 table", gw)
		if err := netnsdir.Do(sb.SlotNetNS, func() error { return nft.DeleteTable6(-1, nft.SlotTable) }); err != nil {
			t.Fatal(err)
		}
		if _, err := ping6(sb.NetNS, slot.SandboxLink, gw, 5*time.Second); err != nil {
			t.Fatalf("control: without the slot's ip6 table the echo is still unanswered: %v", err)
		}
	})

	t.Run("host table", func(t *testing.T) {
		// The slot's ip6 table is gone (above): the slot namespace itself
		// sends, as a compromised slot would, to the host end of its link.
		host := linkLocal(t, "", hostLink)
		// The slot's own end needs its link-local address up too, or the
		// send fails before any table sees it ("cannot assign requested
		// address"): under load it comes a moment after the host's.
		linkLocal(t, sb.SlotNetNS, slot.Uplink)
		if from, err := ping6(sb.SlotNetNS, slot.Uplink, host, blockedWait); !errors.Is(err, errNoAnswer) {
			t.Fatalf("slot → host %s over IPv6: want a dropped echo, got answer %v, error %v", host, from, err)
		}
		t.Logf("slot → host %s over IPv6: dropped by the host's ip6 table", host)
		if err := nft.DeleteTable6(-1, e.Config.Prefix); err != nil {
			t.Fatal(err)
		}
		if _, err := ping6(sb.SlotNetNS, slot.Uplink, host, 5*time.Second); err != nil {
			t.Fatalf("control: without the host's ip6 table the echo is still unanswered: %v", err)
		}
	})

	// Re-applying (what resume and reconcile do) puts both back and turns
	// IPv6 off again.
	if _, err := a.UpdatePolicy(ctx, "sb-v6", nil); err != nil {
		t.Fatal(err)
	}
	if ok, err := inNS(sb.SlotNetNS, func() (bool, error) { return nft.HasTable6(-1, nft.SlotTable) }); !ok || err != nil {
		t.Fatalf("re-apply did not restore the slot's ip6 table: %v", err)
	}
	if v := sysctl(t, sb.SlotNetNS, "ipv6/conf/all/disable_ipv6"); v != "1" {
		t.Fatalf("re-apply left disable_ipv6 = %q in the slot", v)
	}
	if _, err := a.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if ok, err := nft.HasTable6(-1, e.Config.Prefix); !ok || err != nil {
		t.Fatalf("reconcile did not restore the host's ip6 table: %v", err)
	}
}

func inNS(ns string, fn func() (bool, error)) (bool, error) {
	var ok bool
	err := netnsdir.Do(ns, func() (err error) {
		ok, err = fn()
		return err
	})
	return ok, err
}

// sysctl reads a net sysctl as the namespace ns sees it.
func sysctl(t *testing.T, ns, key string) string {
	t.Helper()
	var v []byte
	if err := netnsdir.Do(ns, func() (err error) {
		v, err = os.ReadFile("/proc/sys/net/" + key)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(v))
}

// linkLocal waits for the fe80:: address of link in ns ("" = the host).
func linkLocal(t *testing.T, ns, link string) netip.Addr {
	t.Helper()
	h, err := netlink.NewHandle()
	if ns != "" {
		var nh netns.NsHandle
		if nh, err = netns.GetFromPath(ns); err == nil {
			defer nh.Close()
			h, err = netlink.NewHandleAt(nh)
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		l, err := h.LinkByName(link)
		if err != nil {
			t.Fatal(err)
		}
		addrs, _ := h.AddrList(l, netlink.FAMILY_V6)
		for _, a := range addrs {
			if a.Flags&(unix.IFA_F_TENTATIVE|unix.IFA_F_DADFAILED) != 0 {
				continue // not usable yet (duplicate address detection)
			}
			if ip, ok := netip.AddrFromSlice(a.IP); ok && ip.IsLinkLocalUnicast() {
				return ip.WithZone(link)
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no IPv6 link-local address on %s in %q", link, ns)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// errNoAnswer is a sent echo request that got no reply: what a dropping
// rule looks like (a send that fails proves nothing about the rules).
var errNoAnswer = errors.New("no answer")

// ping6 sends an ICMPv6 echo request out of link in namespace ns and
// waits for a reply (raw socket: the test runs as root).
func ping6(ns, link string, dst netip.Addr, wait time.Duration) (netip.Addr, error) {
	var from netip.Addr
	err := netnsdir.Do(ns, func() error {
		ifi, err := net.InterfaceByName(link)
		if err != nil {
			return err
		}
		fd, err := unix.Socket(unix.AF_INET6, unix.SOCK_RAW, unix.IPPROTO_ICMPV6)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		echo := []byte{128, 0, 0, 0, 0x12, 0x34, 0, 1, 'v', '6'}
		if err := unix.Sendto(fd, echo, 0, &unix.SockaddrInet6{Addr: dst.As16(), ZoneId: uint32(ifi.Index)}); err != nil {
			return fmt.Errorf("send: %w", err)
		}
		tv := unix.NsecToTimeval(wait.Nanoseconds())
		if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
			return err
		}
		buf := make([]byte, 1500)
		for {
			n, sa, err := unix.Recvfrom(fd, buf, 0)
			if err != nil {
				return fmt.Errorf("%w: %w", errNoAnswer, err)
			}
			if n >= 6 && buf[0] == 129 && buf[4] == 0x12 && buf[5] == 0x34 {
				if s, ok := sa.(*unix.SockaddrInet6); ok {
					from = netip.AddrFrom16(s.Addr)
				}
				return nil
			}
		}
	})
	if err == nil && !from.IsValid() {
		err = errors.New("reply without a source")
	}
	return from, err
}
