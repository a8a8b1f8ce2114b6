package clientlimit

import (
	"fmt"
	"testing"
)

func TestClientOf(t *testing.T) {
	for in, want := range map[string]string{
		"192.0.2.7:4000":                 "192.0.2.7",
		"[::ffff:192.0.2.7]:4000":        "192.0.2.7",
		"[2001:db8:1:2:aaaa::1]:4000":    "2001:db8:1:2::/64",
		"[2001:db8:1:2:ffff::9%eth0]:80": "2001:db8:1:2::/64",
		"[2001:db8:1:3::1]:4000":         "2001:db8:1:3::/64",
		"not an address":                 "not an address",
	} {
		if got := ClientOf(in); got != want {
			t.Errorf("ClientOf(%q) = %q, want %q", in, got, want)
		}
	}
}

// A client with an IPv6 /64 cannot escape the limit by using a new
// address for every request; a client in another /64 is not limited by
// it. Control: keyed per address, the same probe is never limited.
func TestLimitPerIPv6Prefix(t *testing.T) {
	probe := func(key func(string) string) (limited, other bool) {
		l := New(20, 100)
		for i := range 100 + 1 {
			l.Fail(key(fmt.Sprintf("[2001:db8:1:2::%x]:443", i+1)))
		}
		return l.Exhausted(key("[2001:db8:1:2::ffff]:443")), l.Exhausted(key("[2001:db8:1:3::1]:443"))
	}
	if limited, other := probe(ClientOf); !limited || other {
		t.Errorf("keyed by /64: next address limited %v (want true), other /64 limited %v (want false)", limited, other)
	}
	perAddress := func(a string) string { return a }
	if limited, _ := probe(perAddress); limited {
		t.Error("control keyed per address: limited, want a fresh bucket per address")
	}
}

// A full table is cut to evictTo, not to one below the bound, so new
// clients do not each pay for a scan of the whole table.
func TestLimitEvictsInBatches(t *testing.T) {
	l := New(20, 100)
	for i := range maxClients {
		l.Fail(fmt.Sprintf("10.%d.%d.%d", i>>16, (i>>8)&255, i&255))
	}
	if len(l.buckets) != maxClients {
		t.Fatalf("%d buckets, want %d", len(l.buckets), maxClients)
	}
	l.Fail("192.0.2.1")
	if n := len(l.buckets); n > evictTo+1 {
		t.Fatalf("after eviction %d buckets, want at most %d", n, evictTo+1)
	}
	if !l.hasBucket("192.0.2.1") {
		t.Error("the new client's bucket was evicted with the others")
	}
}

// hasBucket reports whether client has a bucket in l.
func (l *Limiter) hasBucket(client string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, ok := l.buckets[client]
	return ok
}

// Take refuses once the burst is taken, whatever the order of the
// requests' ends; a refund gives one back.
func TestTakeRefund(t *testing.T) {
	l := New(0, 3)
	for i := range 3 {
		if !l.Take("c") {
			t.Fatalf("take %d refused within the burst", i)
		}
	}
	if l.Take("c") {
		t.Fatal("a fourth take passed a burst of 3")
	}
	l.Refund("c")
	if !l.Take("c") {
		t.Fatal("a take after a refund refused")
	}
	if !l.Take("other") {
		t.Fatal("another client limited")
	}
}
