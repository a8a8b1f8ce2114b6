package leakcheck

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/network/nl"
)

// Network leak kinds.
const (
	KindNetns = "netns"
	KindVeth  = "veth"
	KindTap   = "tap"
	KindLink  = "link"
	KindNft   = "nft"
)

// netLeaks reports what a network-agent scope left: host links named
// NetPrefix-* (veth ends, TAPs created in the wrong namespace, anything
// else by its kind), the host nftables table named NetPrefix, and every
// namespace still pinned in NetnsDir, with the links inside it (a TAP
// lives in its slot namespace, so a leaked slot shows its tap0 there).
func netLeaks(s Scope) []Leak {
	var leaks []Leak
	if s.NetPrefix != "" {
		links, err := nl.Dump(netlink.LinkList)
		if err != nil {
			leaks = append(leaks, Leak{Kind: KindLink, What: "cannot list links: " + err.Error()})
		}
		for _, l := range links {
			if name := l.Attrs().Name; strings.HasPrefix(name, s.NetPrefix+"-") {
				leaks = append(leaks, Leak{Kind: linkKind(l), What: fmt.Sprintf("host link %s (%s)", name, l.Type())})
			}
		}
		if c, err := nftables.New(); err == nil {
			tables, err := c.ListTables()
			if err != nil {
				leaks = append(leaks, Leak{Kind: KindNft, What: "cannot list tables: " + err.Error()})
			}
			for _, t := range tables {
				if t.Name == s.NetPrefix {
					leaks = append(leaks, Leak{Kind: KindNft, What: "host table " + t.Name})
				}
			}
		}
	}
	if s.NetnsDir != "" {
		ents, _ := os.ReadDir(s.NetnsDir)
		for _, e := range ents {
			p := filepath.Join(s.NetnsDir, e.Name())
			what := "pin " + p
			if inside := linksIn(p); inside != "" {
				what += " holding " + inside
			}
			leaks = append(leaks, Leak{Kind: KindNetns, What: what})
		}
	}
	return leaks
}

func linkKind(l netlink.Link) string {
	switch l.Type() {
	case "veth":
		return KindVeth
	case "tuntap":
		return KindTap
	}
	return KindLink
}

// linksIn names the non-loopback links of the namespace pinned at p ("" if
// it is not a pinned namespace).
func linksIn(p string) string {
	var st unix.Statfs_t
	if unix.Statfs(p, &st) != nil || st.Type != 0x6e736673 { // NSFS_MAGIC
		return ""
	}
	ns, err := netns.GetFromPath(p)
	if err != nil {
		return ""
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return ""
	}
	defer h.Close()
	links, _ := nl.Dump(h.LinkList)
	var names []string
	for _, l := range links {
		if l.Attrs().Name != "lo" {
			names = append(names, l.Attrs().Name+"("+l.Type()+")")
		}
	}
	sort.Strings(names)
	return strings.Join(names, ",")
}
