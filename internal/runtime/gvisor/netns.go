package gvisor

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"

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

// nsAddrsFile is where launch records the namespace's host-side addresses
// and routes before runsc takes them over, so Stop can give them back.
const nsAddrsFile = "netns.json"

type savedAddr struct {
	Link string `json:"link"`
	CIDR string `json:"cidr"`
}

type savedRoute struct {
	Link string `json:"link"`
	Dst  string `json:"dst,omitempty"` // "" = default
	Gw   string `json:"gw,omitempty"`
}

type savedNet struct {
	Addrs  []savedAddr  `json:"addrs"`
	Routes []savedRoute `json:"routes"`
}

func nsHandle(path string) (*netlink.Handle, func(), error) {
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return nil, nil, fmt.Errorf("open netns %s: %w", path, err)
	}
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		ns.Close()
		return nil, nil, fmt.Errorf("netlink in %s: %w", path, err)
	}
	return h, func() { h.Close(); ns.Close() }, nil
}

// saveNet records the namespace's addresses and routes in the bundle
// before runsc removes them. A namespace without addresses (runsc took
// them at an earlier launch that Stop did not undo) keeps the old record.
func saveNet(sp *specs.Spec, bundle string) error {
	path := netnsPath(sp)
	if path == "" {
		return nil
	}
	h, done, err := nsHandle(path)
	if err != nil {
		return err
	}
	defer done()
	links, err := h.LinkList()
	if err != nil {
		return err
	}
	var s savedNet
	for _, l := range links {
		if l.Attrs().Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs, err := h.AddrList(l, netlink.FAMILY_V4)
		if err != nil {
			return err
		}
		for _, a := range addrs {
			s.Addrs = append(s.Addrs, savedAddr{l.Attrs().Name, a.IPNet.String()})
		}
		routes, err := h.RouteList(l, netlink.FAMILY_V4)
		if err != nil {
			return err
		}
		for _, r := range routes {
			if r.Gw == nil {
				continue // connected routes come back with their address
			}
			sr := savedRoute{Link: l.Attrs().Name, Gw: r.Gw.String()}
			if r.Dst != nil && r.Dst.String() != "0.0.0.0/0" {
				sr.Dst = r.Dst.String()
			}
			s.Routes = append(s.Routes, sr)
		}
	}
	if len(s.Addrs) == 0 {
		return nil
	}
	b, err := json.Marshal(s)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(bundle, nsAddrsFile), b, 0o600)
}

// restoreNet puts back what saveNet recorded, once the sandbox is gone,
// so the namespace is as it was handed to Start (a rollback or restore in
// place starts runsc in it again, and runsc needs the addresses there).
func restoreNet(sp *specs.Spec, bundle string) error {
	path := netnsPath(sp)
	if path == "" {
		return nil
	}
	b, err := os.ReadFile(filepath.Join(bundle, nsAddrsFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var s savedNet
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("%s: %w", nsAddrsFile, err)
	}
	h, done, err := nsHandle(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil // the slot is gone already: nothing to give back
	}
	if err != nil {
		return err
	}
	defer done()
	for _, a := range s.Addrs {
		l, err := h.LinkByName(a.Link)
		if err != nil {
			continue // the slot was torn down meanwhile
		}
		addr, err := netlink.ParseAddr(a.CIDR)
		if err != nil {
			return err
		}
		if err := h.AddrReplace(l, addr); err != nil {
			return fmt.Errorf("give back %s on %s: %w", a.CIDR, a.Link, err)
		}
	}
	for _, r := range s.Routes {
		l, err := h.LinkByName(r.Link)
		if err != nil {
			continue
		}
		rt := &netlink.Route{LinkIndex: l.Attrs().Index, Gw: net.ParseIP(r.Gw)}
		if r.Dst != "" {
			if _, rt.Dst, err = net.ParseCIDR(r.Dst); err != nil {
				return err
			}
		}
		if err := h.RouteReplace(rt); err != nil {
			return fmt.Errorf("give back route %+v: %w", r, err)
		}
	}
	return os.Remove(filepath.Join(bundle, nsAddrsFile))
}
