package policy

import (
	"errors"
	"net/netip"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/errdefs"
)

func TestParse(t *testing.T) {
	no := false
	p, err := Parse("network", Spec{
		AllowInternet:  &no,
		Allow:          []string{"198.51.100.7", "8.8.8.0/24", " 10.0.0.0/8"},
		Deny:           []string{"0.0.0.0/0"},
		MaxConnections: 10, EgressKbps: 1000,
	})
	if err != nil {
		t.Fatal(err)
	}
	want := []netip.Prefix{netip.MustParsePrefix("8.8.8.0/24"), netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("198.51.100.7/32")}
	if len(p.Allow) != 3 || p.Allow[0] != want[0] || p.Allow[1] != want[1] || p.Allow[2] != want[2] {
		t.Errorf("allow not sorted/normalised: %v", p.Allow)
	}
	if p.InternetAllowed() {
		t.Error("internet should be off")
	}
	back, err := Parse("", p.Spec())
	if err != nil || !back.Equal(p) {
		t.Errorf("round trip: %v %v", back, err)
	}
	if !(Policy{}).InternetAllowed() || !(Policy{}).IsDefault() {
		t.Error("zero policy must be the default: internet allowed")
	}
	if DenyAll().InternetAllowed() {
		t.Error("DenyAll allows the internet")
	}
}

func TestParseRejects(t *testing.T) {
	for _, c := range []struct {
		name  string
		spec  Spec
		field string
		msg   string
	}{
		{"garbage", Spec{Allow: []string{"nope"}}, "n.allow_out[0]", "not an IP address"},
		{"bad mask", Spec{Deny: []string{"1.2.3.0/33"}}, "n.deny_out[0]", "not a CIDR"},
		{"host bits", Spec{Deny: []string{"10.1.2.3/8"}}, "n.deny_out[0]", "did you mean 10.0.0.0/8"},
		{"ipv6", Spec{Allow: []string{"2001:db8::/32"}}, "n.allow_out[0]", "not IPv4"},
		{"overlap", Spec{Allow: []string{"10.0.0.0/8", "10.1.0.0/16"}}, "n.allow_out", "10.1.0.0/16 overlaps 10.0.0.0/8"},
		{"duplicate", Spec{Deny: []string{"1.1.1.1", "1.1.1.1/32"}}, "n.deny_out", "overlaps"},
		{"metadata", Spec{Allow: []string{"169.254.169.254"}}, "n.allow_out[0]", "no sandbox may reach"},
		{"negative conns", Spec{MaxConnections: -1}, "n.max_connections", "negative"},
		{"tiny bandwidth", Spec{EgressKbps: 1}, "n.egress_kbps", "minimum"},
		{"huge bandwidth", Spec{EgressKbps: MaxEgressKbps + 1}, "n.egress_kbps", "exceeds"},
		{"too many", Spec{Deny: make([]string, MaxEntries+1)}, "n.deny_out", "at most"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := Parse("n", c.spec)
			var fe *FieldError
			if !errors.As(err, &fe) || !errdefs.IsInvalidArgument(err) {
				t.Fatalf("want a FieldError, got %v", err)
			}
			if fe.Field != c.field || !strings.Contains(fe.Msg, c.msg) {
				t.Fatalf("got %s: %s; want %s: ...%s...", fe.Field, fe.Msg, c.field, c.msg)
			}
		})
	}
}

func TestNodeCIDR(t *testing.T) {
	if err := CheckNodeCIDR(netip.MustParsePrefix("10.200.0.0/16")); err != nil {
		t.Fatal(err)
	}
	for _, c := range []string{"169.254.0.0/24", "127.0.0.0/16", "10.200.0.1/16", "0.0.0.0/0"} {
		if err := CheckNodeCIDR(netip.MustParsePrefix(c)); !errdefs.IsInvalidArgument(err) {
			t.Errorf("%s: %v", c, err)
		}
	}
	b := Blocked(netip.MustParsePrefix("10.200.0.0/16"))
	if b[len(b)-1].String() != "10.200.0.0/16" {
		t.Errorf("blocked: %v", b)
	}
}

func TestOpened(t *testing.T) {
	opened, err := ParseOpened([]string{"172.31.255.0/24", "10.1.2.3"})
	if err != nil || len(opened) != 2 {
		t.Fatalf("ParseOpened = %v, %v", opened, err)
	}
	for _, bad := range [][]string{{"8.8.8.0/24"}, {"10.0.0.0/8", "10.1.0.0/16"}, {"fd00::/8"}} {
		if _, err := ParseOpened(bad); !errdefs.IsInvalidArgument(err) {
			t.Errorf("ParseOpened(%v) = %v, want invalid argument", bad, err)
		}
	}
	for _, c := range []struct {
		allow []string
		ok    bool
	}{
		{[]string{"172.31.255.7"}, true},
		{[]string{"10.1.2.3/32"}, true},
		{[]string{"0.0.0.0/0"}, true}, // overlaps private ranges, opens none of them
		{[]string{"198.51.100.0/24"}, true},
		{[]string{"172.31.254.7"}, false},
		{[]string{"10.0.0.0/8"}, false},
		{[]string{"8.8.8.8", "192.168.1.0/24"}, false},
	} {
		p, err := Parse("network", Spec{Allow: c.allow})
		if err != nil {
			t.Fatal(err)
		}
		err = CheckOpened("network", p, opened)
		var fe *FieldError
		if c.ok != (err == nil) || (err != nil && (!errors.As(err, &fe) || fe.Field != "network.allow_out" || !strings.Contains(fe.Msg, c.allow[len(c.allow)-1]))) {
			t.Errorf("CheckOpened(%v) = %v, want ok=%v", c.allow, err, c.ok)
		}
	}
}
