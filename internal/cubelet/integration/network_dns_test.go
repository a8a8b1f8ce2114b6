package integration

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/network/policy"
)

// TestNetworkDNS: a runc sandbox in a slot gets a resolv.conf naming the
// node's DNS forwarder, which resolves from inside the sandbox's own
// namespace; a domain policy opens the resolved address only, and refuses
// other names at DNS.
func TestNetworkDNS(t *testing.T) {
	env := cubelettest.New(t, "")
	w := nettest.NewWorld(t)
	allowed, other := w.Addrs[1], w.Addrs[2]
	up := w.ServeDNS(t, map[string][]netip.Addr{"api.allowed.test": {allowed}, "other.test": {other}})
	env.StartNetworkAgent(t, nettest.Options{DNSUpstreams: []string{up.String()}})
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()
	no := false

	res, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox",
		Network: netPolicy(t, policy.Spec{AllowInternet: &no, Allow: []string{"api.allowed.test"}})})
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	a := res.Sandbox
	cleanupDelete(t, svc, a.ID)
	if a.Network.Resolver != network.SandboxGateway.String() {
		t.Fatalf("record's resolver %q", a.Network.Resolver)
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/root/etc/resolv.conf", a.Container.PID))
	if err != nil || !strings.Contains(string(b), "\nnameserver 169.254.0.22\n") {
		t.Fatalf("sandbox's /etc/resolv.conf: %q %v", b, err)
	}
	t.Logf("sandbox /etc/resolv.conf: %q", b)

	p := sbProbe{t: t, pid: a.Container.PID, port: w.Port}
	server := netip.AddrPortFrom(network.SandboxGateway, 53)
	resolve := func(name string) nettest.Answer {
		t.Helper()
		ans, err := nettest.Resolve(ctx, p.ns(), server, "udp", name, 5*time.Second)
		if err != nil {
			t.Fatalf("resolve %s in the sandbox: %v", name, err)
		}
		t.Logf("sandbox resolves %s → %s", name, ans)
		return ans
	}
	// Not yet resolved: closed (control: open right after resolving).
	p.blocked(allowed)
	if ans := resolve("api.allowed.test"); ans.Rcode != dns.RcodeSuccess || len(ans.Addrs) != 1 || ans.Addrs[0] != allowed {
		t.Fatalf("allowed name: %s", ans)
	}
	p.ok(allowed)
	if ans := resolve("other.test"); ans.Rcode != dns.RcodeRefused {
		t.Fatalf("name outside the policy: %s, want REFUSED", ans)
	}
	p.blocked(other)
	// Control for both: with the default policy the name resolves and
	// its address answers.
	if _, err := svc.UpdateNetwork(ctx, a.ID, policy.Policy{}); err != nil {
		t.Fatal(err)
	}
	if ans := resolve("other.test"); ans.Rcode != dns.RcodeSuccess || len(ans.Addrs) != 1 {
		t.Fatalf("default policy: %s", ans)
	}
	p.ok(other)
}
