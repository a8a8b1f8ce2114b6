package ipam

import (
	"net/netip"
	"testing"

	"github.com/cubesandbox/cube/internal/errdefs"
)

func TestAddrs(t *testing.T) {
	s, err := New(netip.MustParsePrefix("10.200.0.0/16"))
	if err != nil {
		t.Fatal(err)
	}
	if s.Size() != 16384 {
		t.Fatalf("size %d", s.Size())
	}
	for _, c := range []struct {
		i             int
		block, gw, ip string
	}{
		{0, "10.200.0.0/30", "10.200.0.1", "10.200.0.2"},
		{3, "10.200.0.12/30", "10.200.0.13", "10.200.0.14"},
		{64, "10.200.1.0/30", "10.200.1.1", "10.200.1.2"},
		{16383, "10.200.255.252/30", "10.200.255.253", "10.200.255.254"},
	} {
		a, err := s.Addrs(c.i)
		if err != nil {
			t.Fatal(err)
		}
		if a.Block.String() != c.block || a.Gateway.String() != c.gw || a.HostIP.String() != c.ip {
			t.Errorf("slot %d: %+v", c.i, a)
		}
	}
	if _, err := s.Addrs(16384); !errdefs.IsInvalidArgument(err) {
		t.Errorf("out of range: %v", err)
	}
}

func TestBadCIDR(t *testing.T) {
	for _, c := range []string{"10.0.0.0/31", "10.0.0.1/24", "::/64", "10.0.0.0/7"} {
		if _, err := New(netip.MustParsePrefix(c)); !errdefs.IsInvalidArgument(err) {
			t.Errorf("%s: %v", c, err)
		}
	}
}

func TestAllocateNextFit(t *testing.T) {
	s, _ := New(netip.MustParsePrefix("10.9.0.0/28")) // 4 slots
	for want := 0; want < 4; want++ {
		if got, err := s.Allocate(); err != nil || got != want {
			t.Fatalf("allocate: %d %v, want %d", got, err, want)
		}
	}
	if _, err := s.Allocate(); !errdefs.IsResourceExhausted(err) {
		t.Fatalf("full: %v", err)
	}
	s.Free(1)
	s.Free(1) // harmless
	if s.InUse() != 3 {
		t.Fatalf("in use %d", s.InUse())
	}
	if got, _ := s.Allocate(); got != 1 {
		t.Fatalf("reuse: %d", got)
	}
	s.Free(2)
	s.Free(0)
	// next-fit: after 1 comes 2 before 0.
	if got, _ := s.Allocate(); got != 2 {
		t.Fatalf("next fit: %d", got)
	}
	if err := s.Reserve(2); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("reserve used: %v", err)
	}
	if err := s.Reserve(0); err != nil {
		t.Fatal(err)
	}
}
