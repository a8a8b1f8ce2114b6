package slotstore

import (
	"net/netip"
	"path/filepath"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/policy"
)

func TestRoundTrip(t *testing.T) {
	p := filepath.Join(t.TempDir(), "net.db")
	s, err := Open(p)
	if err != nil {
		t.Fatal(err)
	}
	no := false
	r := &Record{Index: 7, Kind: network.VM, State: Assigned, SandboxID: "sb1",
		Policy:    policy.Policy{AllowInternet: &no, Allow: []netip.Prefix{netip.MustParsePrefix("1.2.3.0/24")}, MaxConnections: 3},
		CreatedAt: time.Now().UTC().Truncate(time.Second)}
	if err := s.Put(r); err != nil {
		t.Fatal(err)
	}
	if err := s.Put(&Record{Index: 300, State: Ready}); err != nil {
		t.Fatal(err)
	}
	if err := s.SetMeta("cidr", "10.0.0.0/16"); err != nil {
		t.Fatal(err)
	}
	s.Close()
	s, err = Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	l, err := s.List()
	if err != nil || len(l) != 2 {
		t.Fatalf("list after reopen: %v %v", l, err)
	}
	got := l[0]
	if got.Index != 7 || got.Kind != network.VM || got.SandboxID != "sb1" || !got.Policy.Equal(r.Policy) || !got.CreatedAt.Equal(r.CreatedAt) {
		t.Errorf("record changed in the store: %+v", got)
	}
	if v, _ := s.Meta("cidr"); v != "10.0.0.0/16" {
		t.Errorf("meta %q", v)
	}
}

func TestListAndDelete(t *testing.T) {
	s, err := Open(filepath.Join(t.TempDir(), "net.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for _, i := range []int{300, 2, 70000} {
		if err := s.Put(&Record{Index: i, State: Creating}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Delete(2); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete(2); err != nil {
		t.Fatal("second delete:", err)
	}
	l, err := s.List()
	if err != nil || len(l) != 2 || l[0].Index != 300 || l[1].Index != 70000 {
		t.Fatalf("list: %v %v", l, err)
	}
	if v, _ := s.Meta("nope"); v != "" {
		t.Fatal(v)
	}
}
