// Package slot builds and tears down one sandbox network slot in the
// kernel. A slot i of an agent with link prefix P is:
//
//	host namespace                 slot namespace D/P-i            sandbox namespace D/P-i-sb
//	                               (NAT + policy: table "slot")    (container slots only)
//	P-i  GATEWAY/30  <--veth-->    up0  HOSTIP/30
//	                               gw0  169.254.0.22/30 <--veth--> eth0 169.254.0.21/30
//	                               (VM slots: tap0 169.254.0.22/30 instead; the guest is .21)
//
// The sandbox always has 169.254.0.21, so memory snapshots and clones need
// no re-addressing; the host reaches it at HOSTIP, which the slot DNATs to
// 169.254.0.21, and its outbound traffic is SNATed to HOSTIP. The policy
// lives in the slot namespace, which the sandbox never joins, so nothing
// inside the sandbox can change it.
//
// Converge and Release are idempotent and work from any partial state, so
// a create that died half-way is either finished (repair) or undone by
// calling them again.
package slot

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/ipam"
	"github.com/cubesandbox/cube/internal/network/netnsdir"
	"github.com/cubesandbox/cube/internal/network/nft"
	"github.com/cubesandbox/cube/internal/network/nl"
	"github.com/cubesandbox/cube/internal/network/policy"
)

// Fixed names and addresses, the same in every slot.
const (
	Uplink      = "up0"  // slot end of the veth pair to the host
	GatewayLink = "gw0"  // slot end of the veth pair to the sandbox namespace
	SandboxLink = "eth0" // the sandbox's interface
)

// Layout locates slot Index of an agent: its names, paths and addresses.
type Layout struct {
	Index    int
	Kind     network.Kind
	Dir      string // where namespaces are pinned
	Prefix   string // link and namespace name prefix
	Addrs    ipam.Addrs
	NodeCIDR netip.Prefix
	Opened   []netip.Prefix // private ranges the operator lets policies open
	// DNS: the agent's DNS forwarder serves this slot at the sandbox's
	// gateway address, so the slot table lets the sandbox reach port 53
	// there.
	DNS bool
	// ProxyPort is where the agent's egress proxy listens in the slot (0:
	// no proxy): see nft.Slot.
	ProxyPort uint16
}

// HostLink is the host end of the veth pair.
func (l Layout) HostLink() string { return l.Prefix + "-" + strconv.Itoa(l.Index) }

// SlotNS is the pinned slot namespace.
func (l Layout) SlotNS() string { return filepath.Join(l.Dir, l.HostLink()) }

// SandboxNS is the pinned sandbox namespace of a container slot.
func (l Layout) SandboxNS() string { return filepath.Join(l.Dir, l.HostLink()+"-sb") }

// RuntimeNS is the namespace the sandbox's runtime joins.
func (l Layout) RuntimeNS() string {
	if l.Kind == network.VM {
		return l.SlotNS()
	}
	return l.SandboxNS()
}

// Rules returns the slot table for policy p.
func (l Layout) Rules(p policy.Policy) nft.Slot {
	s := nft.Slot{Uplink: Uplink, Gateway: l.Addrs.Gateway, HostIP: l.Addrs.HostIP,
		SandboxIP: network.SandboxIP, NodeCIDR: l.NodeCIDR, Opened: l.Opened, Policy: p}
	if l.DNS {
		s.Resolver = network.SandboxGateway
		s.ProxyPort = l.ProxyPort
	}
	return s
}

// Converge makes every piece of the slot exist and be configured, and
// applies policy p. It returns the pieces it had to create: all of them
// for a new slot, none for an intact one. Failpoints "slot/<piece>" sit
// before each piece so tests can crash the agent at any point.
func Converge(ctx context.Context, l Layout, p policy.Policy) (created []string, err error) {
	step := func(name string, fn func() (bool, error)) error {
		if err != nil {
			return err
		}
		if err = failpoint.Eval(ctx, "slot/"+name); err != nil {
			return err
		}
		made, ferr := fn()
		if ferr != nil {
			err = fmt.Errorf("slot %d: %s: %w", l.Index, name, ferr)
			return err
		}
		if made {
			created = append(created, name)
		}
		return nil
	}
	_ = step("netns", func() (bool, error) { return ensureNS(l.SlotNS(), true) })
	if l.Kind == network.Container {
		_ = step("sandbox-netns", func() (bool, error) { return ensureNS(l.SandboxNS(), false) })
	}
	if err != nil {
		return created, err
	}
	slotNS, err := netns.GetFromPath(l.SlotNS())
	if err != nil {
		return created, fmt.Errorf("slot %d: open netns: %w", l.Index, err)
	}
	defer slotNS.Close()
	host, err := netlink.NewHandle()
	if err != nil {
		return created, err
	}
	defer host.Close()
	in, err := netlink.NewHandleAt(slotNS)
	if err != nil {
		return created, fmt.Errorf("slot %d: netlink in slot netns: %w", l.Index, err)
	}
	defer in.Close()

	_ = step("uplink", func() (bool, error) { return ensureVeth(host, in, l.HostLink(), Uplink, slotNS) })
	_ = step("uplink-addr", func() (bool, error) {
		if err := linkUp(host, l.HostLink(), netip.PrefixFrom(l.Addrs.Gateway, ipam.BlockBits)); err != nil {
			return false, err
		}
		if err := linkUp(in, "lo", netip.Prefix{}); err != nil {
			return false, err
		}
		if err := linkUp(in, Uplink, netip.PrefixFrom(l.Addrs.HostIP, ipam.BlockBits)); err != nil {
			return false, err
		}
		return false, defaultRoute(in, Uplink, l.Addrs.Gateway)
	})
	switch l.Kind {
	case network.VM:
		_ = step("tap", func() (bool, error) { return ensureTap(in, l.SlotNS()) })
		_ = step("tap-addr", func() (bool, error) {
			return false, linkUp(in, network.TapName, netip.PrefixFrom(network.SandboxGateway, network.SandboxPrefixBits))
		})
	default:
		_ = step("sandbox-link", func() (bool, error) { return ensureSandboxLink(in, l) })
	}
	if err != nil {
		return created, err
	}
	fd, err := os.Open(l.SlotNS())
	if err != nil {
		return created, err
	}
	defer fd.Close()
	_ = step("rules", func() (bool, error) {
		had, err := nft.HasTable(int(fd.Fd()), nft.SlotTable)
		if err != nil {
			return false, err
		}
		return !had, nft.ApplySlot(int(fd.Fd()), l.Rules(p))
	})
	return created, err
}

// ensureNS pins a namespace at path unless one is pinned there, and sets
// its sysctls: IPv6 off (slots are IPv4 only: an IPv6 path would bypass
// the policy), forwarding on in the slot namespace.
func ensureNS(path string, router bool) (bool, error) {
	made := false
	if err := netnsdir.Create(path); err == nil {
		made = true
	} else if !errors.Is(err, netnsdir.ErrExists) {
		return false, err
	}
	kv := []string{"ipv6/conf/all/disable_ipv6", "1", "ipv6/conf/default/disable_ipv6", "1"}
	if router {
		kv = append(kv, "ipv4/ip_forward", "1")
	}
	return made, netnsdir.Sysctl(path, kv...)
}

// ensureVeth makes the pair name (in h's namespace) <-> peer (in the
// namespace ns, reached through hp). A half of a pair whose other half is
// gone (its namespace was lost) is deleted and the pair made again.
func ensureVeth(h, hp *netlink.Handle, name, peer string, ns netns.NsHandle) (bool, error) {
	_, errA := h.LinkByName(name)
	_, errB := hp.LinkByName(peer)
	if errA == nil && errB == nil {
		return false, nil
	}
	if errA == nil {
		if err := delLink(h, name); err != nil {
			return false, err
		}
	}
	if errB == nil {
		if err := delLink(hp, peer); err != nil {
			return false, err
		}
	}
	v := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: peer, PeerNamespace: netlink.NsFd(int(ns))}
	if err := h.LinkAdd(v); err != nil {
		return false, fmt.Errorf("add veth %s/%s: %w", name, peer, err)
	}
	return true, nil
}

func ensureSandboxLink(in *netlink.Handle, l Layout) (bool, error) {
	sbNS, err := netns.GetFromPath(l.SandboxNS())
	if err != nil {
		return false, err
	}
	defer sbNS.Close()
	sb, err := netlink.NewHandleAt(sbNS)
	if err != nil {
		return false, err
	}
	defer sb.Close()
	made, err := ensureVeth(in, sb, GatewayLink, SandboxLink, sbNS)
	if err != nil {
		return false, err
	}
	if err := linkUp(in, GatewayLink, netip.PrefixFrom(network.SandboxGateway, network.SandboxPrefixBits)); err != nil {
		return made, err
	}
	if err := linkUp(sb, "lo", netip.Prefix{}); err != nil {
		return made, err
	}
	if err := linkUp(sb, SandboxLink, netip.PrefixFrom(network.SandboxIP, network.SandboxPrefixBits)); err != nil {
		return made, err
	}
	return made, defaultRoute(sb, SandboxLink, network.SandboxGateway)
}

// ensureTap makes a persistent TAP in the slot namespace. TUNSETIFF makes
// the device in the calling thread's namespace, hence Do.
func ensureTap(in *netlink.Handle, nsPath string) (bool, error) {
	if _, err := in.LinkByName(network.TapName); err == nil {
		return false, nil
	}
	err := netnsdir.Do(nsPath, func() error {
		return netlink.LinkAdd(&netlink.Tuntap{
			LinkAttrs: netlink.LinkAttrs{Name: network.TapName},
			Mode:      netlink.TUNTAP_MODE_TAP,
			// No multi-queue: QEMU must open it with the same queue mode.
			Flags: netlink.TUNTAP_NO_PI | netlink.TUNTAP_ONE_QUEUE | netlink.TUNTAP_VNET_HDR,
		})
	})
	if err != nil {
		return false, fmt.Errorf("add tap: %w", err)
	}
	return true, nil
}

// linkUp sets addr (if valid) as the link's only IPv4 address and brings
// it up.
func linkUp(h *netlink.Handle, name string, addr netip.Prefix) error {
	link, err := h.LinkByName(name)
	if err != nil {
		return fmt.Errorf("link %s: %w", name, err)
	}
	if addr.IsValid() {
		want := &netlink.Addr{IPNet: netlink.NewIPNet(addr.Addr().AsSlice())}
		want.IPNet.Mask = netMask(addr.Bits())
		have, err := nl.Dump(func() ([]netlink.Addr, error) { return h.AddrList(link, netlink.FAMILY_V4) })
		if err != nil {
			return err
		}
		for _, a := range have {
			if !a.Equal(*want) {
				if err := h.AddrDel(link, &a); err != nil {
					return fmt.Errorf("remove stale address %s from %s: %w", a.IPNet, name, err)
				}
			}
		}
		if err := h.AddrReplace(link, want); err != nil {
			return fmt.Errorf("address %s on %s: %w", addr, name, err)
		}
	}
	if link.Attrs().Flags&netFlagUp == 0 {
		if err := h.LinkSetUp(link); err != nil {
			return fmt.Errorf("up %s: %w", name, err)
		}
	}
	return nil
}

const netFlagUp = 1 // net.FlagUp

func netMask(bits int) []byte {
	m := make([]byte, 4)
	for i := 0; i < bits; i++ {
		m[i/8] |= 0x80 >> (i % 8)
	}
	return m
}

func defaultRoute(h *netlink.Handle, dev string, gw netip.Addr) error {
	link, err := h.LinkByName(dev)
	if err != nil {
		return err
	}
	r := &netlink.Route{LinkIndex: link.Attrs().Index, Gw: gw.AsSlice(), Dst: nil}
	if err := h.RouteReplace(r); err != nil {
		return fmt.Errorf("default route via %s: %w", gw, err)
	}
	return nil
}

func delLink(h *netlink.Handle, name string) error {
	link, err := h.LinkByName(name)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			return nil
		}
		return err
	}
	if err := h.LinkDel(link); err != nil && !errors.Is(err, unix.ENODEV) {
		return fmt.Errorf("delete link %s: %w", name, err)
	}
	return nil
}

// Release removes the slot's kernel objects: the host end of the veth
// (which takes its peer along at once), then the namespace pins. The
// namespaces and what is left inside them go when their last user does;
// a sandbox still running keeps its own namespace, unreachable. Failpoints
// "slot/release/<piece>" sit before each piece.
func Release(ctx context.Context, l Layout) error {
	if err := failpoint.Eval(ctx, "slot/release/uplink"); err != nil {
		return err
	}
	host, err := netlink.NewHandle()
	if err != nil {
		return err
	}
	defer host.Close()
	if err := delLink(host, l.HostLink()); err != nil {
		return fmt.Errorf("slot %d: %w", l.Index, err)
	}
	if err := failpoint.Eval(ctx, "slot/release/netns"); err != nil {
		return err
	}
	return errors.Join(netnsdir.Remove(l.SandboxNS()), netnsdir.Remove(l.SlotNS()))
}
