package agent

import (
	"log/slog"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/testenv"
)

// TestRaiseNeighbourTable checks that the host's ARP table limits end at
// least at what a /20 node's 1,024 slots need (gc_thresh1 1024, 2 2048,
// 3 4096) and that no limit went down. The kernel's default gc_thresh3 is
// 1024: without the raise, the neighbour table fills once the host has
// reached ~1,000 slots and connections to the next ones stall in SYN
// retransmits ("neighbor table overflow" in the kernel log).
func TestRaiseNeighbourTable(t *testing.T) {
	testenv.RequireRoot(t, "writes /proc/sys/net/ipv4/neigh")
	read := func(name string) int64 {
		b, err := os.ReadFile(neighSysctl + name)
		if err != nil {
			t.Fatal(err)
		}
		n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	names := []string{"gc_thresh1", "gc_thresh2", "gc_thresh3"}
	before := map[string]int64{}
	for _, n := range names {
		before[n] = read(n)
	}
	raiseNeighbourTable(20, slog.Default())
	for i, n := range names {
		got, want := read(n), int64(1024)<<i
		t.Logf("%s: %d -> %d (a /20 needs %d)", n, before[n], got, want)
		if got < want || got < before[n] {
			t.Errorf("%s = %d, want >= max(%d, %d)", n, got, want, before[n])
		}
	}
}
