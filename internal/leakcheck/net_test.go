package leakcheck

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"

	"github.com/cubesandbox/cube/internal/network/netnsdir"
)

// TestNetworkLeaks: pinned namespaces (with the TAP inside), host veths
// and TAPs with the scope's prefix and the scope's nft table are found,
// and nothing is once they are gone.
func TestNetworkLeaks(t *testing.T) {
	requireRoot(t)
	b := make([]byte, 2)
	_, _ = rand.Read(b)
	prefix := "lk" + hex.EncodeToString(b)
	dir := t.TempDir()
	s := Scope{NetPrefix: prefix, NetnsDir: dir}

	pin := filepath.Join(dir, prefix+"-1")
	if err := netnsdir.Create(pin); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = netnsdir.Remove(pin) }() // a safety net: removed below
	if err := netnsdir.Do(pin, func() error {
		return netlink.LinkAdd(&netlink.Tuntap{LinkAttrs: netlink.LinkAttrs{Name: "tap0"}, Mode: netlink.TUNTAP_MODE_TAP})
	}); err != nil {
		t.Fatal(err)
	}
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: prefix + "-2"}, PeerName: "p" + prefix}
	if err := netlink.LinkAdd(veth); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = netlink.LinkDel(veth) }() // a safety net: deleted below
	tap := &netlink.Tuntap{LinkAttrs: netlink.LinkAttrs{Name: prefix + "-3"}, Mode: netlink.TUNTAP_MODE_TAP}
	if err := netlink.LinkAdd(tap); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = netlink.LinkDel(tap) }() // a safety net: deleted below
	c, err := nftables.New()
	if err != nil {
		t.Fatal(err)
	}
	table := &nftables.Table{Family: nftables.TableFamilyIPv4, Name: prefix}
	c.AddTable(table)
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	defer func() { c.DelTable(table); _ = c.Flush() }()

	leaks, err := Check(context.Background(), s)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, l := range leaks {
		got = append(got, l.String())
	}
	want := []string{
		"netns: pin " + pin + " holding tap0(tuntap)",
		"nft: host table " + prefix,
		"tap: host link " + prefix + "-3 (tuntap)",
		"veth: host link " + prefix + "-2 (veth)",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("leaks:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}

	if err := netnsdir.Remove(pin); err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkDel(veth); err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkDel(tap); err != nil {
		t.Fatal(err)
	}
	c.DelTable(table)
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	if leaks, _ := Check(context.Background(), s); len(leaks) != 0 {
		t.Fatalf("after removal: %v", leaks)
	}
}
