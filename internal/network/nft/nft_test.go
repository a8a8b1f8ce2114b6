package nft

import (
	"flag"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/network/netnsdir"
	"github.com/cubesandbox/cube/internal/network/policy"
	"github.com/cubesandbox/cube/internal/testenv"
)

var update = flag.Bool("update", false, "rewrite the golden files")

// nsFixture pins a scratch namespace for one test.
func nsFixture(t *testing.T) (path string, fd int) {
	t.Helper()
	testenv.RequireRoot(t, "network namespaces")
	path = filepath.Join(t.TempDir(), "ns")
	if err := netnsdir.Create(path); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		f.Close()
		if err := netnsdir.Remove(path); err != nil {
			t.Error(err)
		}
	})
	return path, int(f.Fd())
}

// listTable runs the nft binary inside the namespace: tests only, to
// compare what the kernel holds with the golden file.
func listTable(t *testing.T, nsPath, table string) string {
	t.Helper()
	return listFamily(t, nsPath, "ip", table)
}

func listFamily(t *testing.T, nsPath, family, table string) string {
	t.Helper()
	if _, err := exec.LookPath("nft"); err != nil {
		testenv.Missing(t, "nft binary not installed (hack/deps.sh installs it for tests)")
	}
	var out []byte
	err := netnsdir.Do(nsPath, func() error {
		var err error
		out, err = exec.Command("nft", "list", "table", family, table).CombinedOutput()
		return err
	})
	if err != nil {
		t.Fatalf("nft list: %v\n%s", err, out)
	}
	return string(out)
}

func golden(t *testing.T, name, got string) {
	t.Helper()
	p := filepath.Join("testdata", name)
	if *update {
		if err := os.WriteFile(p, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(p)
	if err != nil {
		t.Fatalf("%v (run with -update)", err)
	}
	if string(want) != got {
		t.Errorf("%s differs from the kernel's rule set (run with -update if intended):\n--- got\n%s\n--- want\n%s", name, got, want)
	}
}

func testSlot(p policy.Policy) Slot {
	return Slot{
		Uplink:    "up0",
		Gateway:   netip.MustParseAddr("10.200.0.13"),
		HostIP:    netip.MustParseAddr("10.200.0.14"),
		SandboxIP: netip.MustParseAddr("169.254.0.21"),
		NodeCIDR:  netip.MustParsePrefix("10.200.0.0/16"),
		Resolver:  netip.MustParseAddr("169.254.0.22"),
		ProxyPort: 15001,
		Policy:    p,
	}
}

func TestSlotGolden(t *testing.T) {
	path, fd := nsFixture(t)
	no := false
	p, err := policy.Parse("", policy.Spec{
		AllowInternet:  &no,
		Allow:          []string{"198.51.100.0/24", "0.0.0.0/1", "api.example.com"},
		Deny:           []string{"198.51.100.7", "240.0.0.0/4"},
		MaxConnections: 100, EgressKbps: 8000,
	})
	if err != nil {
		t.Fatal(err)
	}
	s := testSlot(p)
	s.Opened = []netip.Prefix{netip.MustParsePrefix("10.1.0.0/16"), netip.MustParsePrefix("192.168.7.0/24")}
	if err := ApplySlot(fd, s); err != nil {
		t.Fatal(err)
	}
	golden(t, "slot.nft", listTable(t, path, SlotTable))

	// A second apply replaces the table (no duplicate rules, old elements gone).
	if err := ApplySlot(fd, testSlot(policy.Policy{})); err != nil {
		t.Fatal(err)
	}
	golden(t, "slot-default.nft", listTable(t, path, SlotTable))
	ts, err := Tables(fd)
	if err != nil || len(ts) != 1 {
		t.Fatalf("tables %v %v", ts, err)
	}
	// The IPv6 table beside it, once (applied twice above).
	golden(t, "slot6.nft", listFamily(t, path, "ip6", SlotTable))
	if err := DeleteTable(fd, SlotTable); err != nil {
		t.Fatal(err)
	}
	for _, has := range []func(int, string) (bool, error){HasTable, HasTable6} {
		if ok, err := has(fd, SlotTable); ok || err != nil {
			t.Fatalf("after DeleteTable: table still there (%v, %v)", ok, err)
		}
	}
}

// A rejected batch must leave the previous rule set whole: the
// transaction is all or nothing.
func TestSlotApplyAtomic(t *testing.T) {
	path, fd := nsFixture(t)
	if err := ApplySlot(fd, testSlot(policy.Policy{})); err != nil {
		t.Fatal(err)
	}
	before := listTable(t, path, SlotTable)
	bad := testSlot(policy.Policy{})
	// Overlapping elements are refused by the kernel's interval set.
	bad.Policy.Deny = []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("10.1.0.0/16")}
	if err := ApplySlot(fd, bad); err == nil {
		t.Fatal("overlapping set elements were accepted")
	}
	if after := listTable(t, path, SlotTable); after != before {
		t.Fatalf("failed apply changed the rule set:\n%s", after)
	}
}

func TestHostGolden(t *testing.T) {
	path, _ := nsFixture(t)
	// ApplyHost works on the caller's namespace: run it inside the
	// scratch one so the test never touches the real host's rules.
	err := netnsdir.Do(path, func() error {
		return ApplyHost(Host{Table: "cubetest", LinkPrefix: "cubetest-", NodeCIDR: netip.MustParsePrefix("10.200.0.0/16")})
	})
	if err != nil {
		t.Fatal(err)
	}
	golden(t, "host.nft", listTable(t, path, "cubetest"))
	golden(t, "host6.nft", listFamily(t, path, "ip6", "cubetest"))
	if err := netnsdir.Do(path, func() error { return DeleteTable(-1, "cubetest") }); err != nil {
		t.Fatal(err)
	}
	if err := netnsdir.Do(path, func() error { return DeleteTable(-1, "cubetest") }); err != nil {
		t.Fatalf("second delete: %v", err)
	}
}

// UpdateSlotPolicy must leave exactly what a fresh ApplySlot would: it is
// a shortcut, not a different rule set.
func TestUpdateSlotPolicyEqualsApply(t *testing.T) {
	pathA, fdA := nsFixture(t)
	pathB, fdB := nsFixture(t)
	no := false
	from := policy.DenyAll()
	steps := []policy.Spec{
		{},
		{AllowInternet: &no, Allow: []string{"198.51.100.0/24"}},
		{AllowInternet: &no, Allow: []string{"198.51.100.0/24", "8.8.8.8"}}, // only grows
		{Deny: []string{"203.0.113.7", "8.8.0.0/16"}, Allow: []string{"8.8.8.8"}},
		{Deny: []string{"203.0.113.7"}, MaxConnections: 5}, // a knob: rules change
		{MaxConnections: 5, EgressKbps: 100},
		{AllowInternet: &no, MaxConnections: 5, EgressKbps: 100},
		{AllowInternet: &no, Allow: []string{"api.example.com"}, MaxConnections: 5, EgressKbps: 100}, // proxied on
		{AllowInternet: &no, Allow: []string{"api.example.com", "*.example.org"}, MaxConnections: 5, EgressKbps: 100},
		{AllowInternet: &no, MaxConnections: 5, EgressKbps: 100}, // proxied off
		{Credentials: []policy.Credential{{Host: "api.example.com", Header: "Authorization", Value: "Bearer x"}}},
		{},
	}
	if err := ApplySlot(fdA, testSlot(from)); err != nil {
		t.Fatal(err)
	}
	for i, sp := range steps {
		to, err := policy.Parse("", sp)
		if err != nil {
			t.Fatal(err)
		}
		if err := UpdateSlotPolicy(fdA, testSlot(to), from); err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
		if err := ApplySlot(fdB, testSlot(to)); err != nil {
			t.Fatal(err)
		}
		if a, b := listTable(t, pathA, SlotTable), listTable(t, pathB, SlotTable); a != b {
			t.Fatalf("step %d: update and apply differ:\n--- update\n%s\n--- apply\n%s", i, a, b)
		}
		// The update is remembered as the Slot it turned the table
		// into: a re-apply of that Slot commits nothing.
		_, g0, err := generation(fdA)
		if err != nil {
			t.Fatal(err)
		}
		if err := ApplySlot(fdA, testSlot(to)); err != nil {
			t.Fatal(err)
		}
		if _, g, err := generation(fdA); err != nil || g != g0 {
			t.Fatalf("step %d: the re-apply after the update committed (generation %d -> %d, %v)", i, g0, g, err)
		}
		from = to
	}
}

// A table someone emptied of its chains (sets left) is replaced, not
// added to.
func TestSlotApplyOverTamperedTable(t *testing.T) {
	path, fd := nsFixture(t)
	if err := ApplySlot(fd, testSlot(policy.Policy{})); err != nil {
		t.Fatal(err)
	}
	want := listTable(t, path, SlotTable)
	err := netnsdir.Do(path, func() error {
		for _, ch := range []string{"prerouting", "postrouting", "input", "forward", "egress"} {
			if out, err := exec.Command("nft", "delete", "chain", "ip", SlotTable, ch).CombinedOutput(); err != nil {
				return fmt.Errorf("%v: %s", err, out)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := ApplySlot(fd, testSlot(policy.Policy{})); err != nil {
		t.Fatal(err)
	}
	if got := listTable(t, path, SlotTable); got != want {
		t.Fatalf("after re-apply:\n%s", got)
	}
}

// TestResolvedSet: the forwarder's additions refresh an element's
// timeout, survive a re-apply (refill) of the same rule set, and go with a
// prune.
func TestResolvedSet(t *testing.T) {
	_, fd := nsFixture(t)
	s := testSlot(policy.Policy{})
	if err := ApplySlot(fd, s); err != nil {
		t.Fatal(err)
	}
	a, b := netip.MustParseAddr("198.51.100.10"), netip.MustParseAddr("198.51.100.11")
	if err := AddResolved(fd, []Resolved{{a, 2 * time.Second}, {b, time.Hour}}); err != nil {
		t.Fatal(err)
	}
	if err := AddResolved(fd, []Resolved{{a, time.Hour}}); err != nil {
		t.Fatal(err)
	}
	live := func() map[netip.Addr]time.Duration {
		rs, err := ListResolved(fd)
		if err != nil {
			t.Fatal(err)
		}
		m := map[netip.Addr]time.Duration{}
		for _, r := range rs {
			m[r.Addr] = r.Timeout
		}
		return m
	}
	if m := live(); m[a] < time.Minute || m[b] < time.Minute {
		t.Fatalf("re-add did not refresh the timeout: %v", m)
	}
	if err := ApplySlot(fd, s); err != nil {
		t.Fatal(err)
	}
	if m := live(); len(m) != 2 {
		t.Fatalf("re-apply lost resolved addresses: %v", m)
	}
	if err := PruneResolved(fd, []Resolved{{b, time.Hour}}); err != nil {
		t.Fatal(err)
	}
	if m := live(); len(m) != 1 || m[b] == 0 {
		t.Fatalf("after prune: %v", m)
	}
}

// TestSlotReapplyUnchanged: applying the same Slot again to a namespace
// where nothing committed since commits nothing (the ruleset generation
// stays), and is fast; a different Slot, or anything committed there in
// between (here a chain emptied by hand, the control), is applied in full
// and the table is again exactly what the Slot describes. The DNS
// forwarder's additions to the resolved set do not count as such a
// commit.
func TestSlotReapplyUnchanged(t *testing.T) {
	path, fd := nsFixture(t)
	open := testSlot(policy.Policy{})
	if err := ApplySlot(fd, open); err != nil {
		t.Fatal(err)
	}
	want := listTable(t, path, SlotTable)
	gen := func() uint32 {
		t.Helper()
		_, g, err := generation(fd)
		if err != nil {
			t.Fatal(err)
		}
		return g
	}
	g0 := gen()
	begin := time.Now()
	if err := ApplySlot(fd, open); err != nil {
		t.Fatal(err)
	}
	took := time.Since(begin)
	if g := gen(); g != g0 {
		t.Fatalf("re-apply of the same Slot committed (generation %d -> %d)", g0, g)
	}
	t.Logf("unchanged re-apply: %v", took)

	// Another Slot: applied, although nothing else committed.
	no := false
	closed := testSlot(policy.Policy{AllowInternet: &no})
	if err := ApplySlot(fd, closed); err != nil {
		t.Fatal(err)
	}
	if g := gen(); g == g0 {
		t.Fatal("a different Slot was not committed")
	}
	if got := listTable(t, path, SlotTable); got == want {
		t.Fatal("the table did not change with the Slot")
	}
	if err := ApplySlot(fd, open); err != nil {
		t.Fatal(err)
	}
	if got := listTable(t, path, SlotTable); got != want {
		t.Fatalf("back to the first Slot:\n%s", got)
	}

	// Control: a commit by someone else in between is repaired.
	err := netnsdir.Do(path, func() error {
		out, err := exec.Command("nft", "flush", "chain", "ip", SlotTable, "egress").CombinedOutput()
		if err != nil {
			return fmt.Errorf("%v: %s", err, out)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := listTable(t, path, SlotTable); got == want {
		t.Fatal("flushing the egress chain changed nothing")
	}
	begin = time.Now()
	if err := ApplySlot(fd, open); err != nil {
		t.Fatal(err)
	}
	t.Logf("re-apply after a foreign commit: %v", time.Since(begin))
	if got := listTable(t, path, SlotTable); got != want {
		t.Fatalf("after a foreign commit, the re-apply left:\n%s", got)
	}

	// The DNS forwarder's additions keep the remembered generation in
	// step: the next re-apply still commits nothing, and keeps them.
	g2 := gen()
	addr := netip.MustParseAddr("203.0.113.7")
	if err := AddResolved(fd, []Resolved{{Addr: addr, Timeout: time.Minute}}); err != nil {
		t.Fatal(err)
	}
	g1 := gen()
	if g1 == g2 {
		t.Fatal("AddResolved committed nothing")
	}
	if err := ApplySlot(fd, open); err != nil {
		t.Fatal(err)
	}
	if g := gen(); g != g1 {
		t.Fatalf("re-apply after the forwarder's addition committed (generation %d -> %d)", g1, g)
	}
	if rs, err := ListResolved(fd); err != nil || len(rs) != 1 || rs[0].Addr != addr {
		t.Fatalf("resolved set after the re-apply: %v, %v", rs, err)
	}
}

// TestSlotForeignCommitDuringApply: a commit by someone else between
// ApplySlot's own commit and its reading of the generation is never taken
// for ApplySlot's: the next ApplySlot of the same Slot commits in full and
// repairs what the other commit changed.
func TestSlotForeignCommitDuringApply(t *testing.T) {
	path, fd := nsFixture(t)
	open := testSlot(policy.Policy{})
	flushEgress := func() {
		err := netnsdir.Do(path, func() error {
			out, err := exec.Command("nft", "flush", "chain", "ip", SlotTable, "egress").CombinedOutput()
			if err != nil {
				return fmt.Errorf("%v: %s", err, out)
			}
			return nil
		})
		if err != nil {
			t.Error(err)
		}
	}
	afterSlotCommit = flushEgress
	err := ApplySlot(fd, open)
	afterSlotCommit = nil
	if err != nil {
		t.Fatal(err)
	}
	_, g0, err := generation(fd)
	if err != nil {
		t.Fatal(err)
	}
	if err := ApplySlot(fd, open); err != nil {
		t.Fatal(err)
	}
	if _, g, _ := generation(fd); g == g0 {
		t.Fatal("the re-apply after a foreign commit during the apply committed nothing")
	}
	fresh, freshFD := nsFixture(t)
	if err := ApplySlot(freshFD, open); err != nil {
		t.Fatal(err)
	}
	if got, want := listTable(t, path, SlotTable), listTable(t, fresh, SlotTable); got != want {
		t.Fatalf("after the re-apply:\n%s\nwant:\n%s", got, want)
	}
}
