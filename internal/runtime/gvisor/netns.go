package gvisor

import (
	"fmt"
	"net"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// releaseAddrs removes the host kernel's IP addresses from the interfaces
// of the sandbox's network namespace.
//
// With --network=sandbox, runsc copies each interface's addresses and
// routes into gVisor's netstack at start and then deletes them from the
// host side, so that only the netstack answers on them. Anything that
// later re-adds them in the namespace (a network-agent repairing the slot
// on resume) makes the host kernel answer first, with RSTs for every TCP
// port: the sandbox looks dead. Called before a sandbox runs again.
func releaseAddrs(sp *specs.Spec) error {
	path := netnsPath(sp)
	if path == "" {
		return nil
	}
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return fmt.Errorf("open netns %s: %w", path, err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return fmt.Errorf("netlink in %s: %w", path, err)
	}
	defer h.Close()
	links, err := h.LinkList()
	if err != nil {
		return fmt.Errorf("links in %s: %w", path, err)
	}
	for _, l := range links {
		if l.Attrs().Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs, err := h.AddrList(l, netlink.FAMILY_ALL)
		if err != nil {
			return fmt.Errorf("addresses of %s in %s: %w", l.Attrs().Name, path, err)
		}
		for _, a := range addrs {
			if a.IP.IsLinkLocalUnicast() && a.IP.To4() == nil {
				continue // IPv6 link-local: runsc leaves it too
			}
			if err := h.AddrDel(l, &a); err != nil {
				return fmt.Errorf("remove %s from %s in %s: %w", a.IPNet, l.Attrs().Name, path, err)
			}
		}
	}
	return nil
}

func netnsPath(sp *specs.Spec) string {
	if sp.Linux == nil {
		return ""
	}
	for _, ns := range sp.Linux.Namespaces {
		if ns.Type == specs.NetworkNamespace {
			return ns.Path
		}
	}
	return ""
}
