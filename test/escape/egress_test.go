package escape

import (
	"context"
	"crypto/tls"
	"fmt"
	"net/netip"
	"time"

	"github.com/google/nftables"

	"github.com/cubesandbox/cube/internal/network/netnsdir"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/network/nft"
	"github.com/cubesandbox/cube/internal/network/policy"
)

// Egress rows: a domain-restricted sandbox (allow_out api.allowed.test
// and cdn.allowed.test, internet off) that resolved both names through
// its own resolver tries to reach names and addresses the policy does not
// give it, over the addresses it does. The slot's address rules alone let
// each through (the addresses were resolved for allowed names): the
// egress proxy's name checks are what stop them.
var egressRows = []struct{ Name, Attempt string }{
	{"egress-forged-sni", "TLS with SNI evil.test to api.allowed.test's address (curl --resolve evil.test:443:<allowed IP>)"},
	{"egress-other-addr", "TLS with SNI api.allowed.test to cdn.allowed.test's address (an allowed name on another allowed name's address)"},
	{"egress-ip-literal", "TLS without a server name to api.allowed.test's address (an IP literal)"},
	{"egress-host-header", "HTTP with Host: evil.test to api.allowed.test's address"},
	{"egress-second-host", "HTTP: a request for api.allowed.test, then one for evil.test on the same connection"},
}

const egressStops = "egress proxy: TLS SNI / HTTP Host against the policy, the address against the name's DNS answers"

func init() {
	for _, r := range egressRows {
		table = append(table, row{Name: r.Name, Attempt: r.Attempt, Stops: egressStops,
			Control: "runc slot with the redirect to the proxy removed (the proxied set flushed): the same probe gets an answer",
			Expect:  map[string]expect{}})
	}
}

// egressWorld gives the world DNS names and web servers (HTTP 80, HTTPS
// 443 on every world address); it returns the agent's DNS upstream.
func (s *suite) egressWorld() netip.AddrPort {
	up := s.w.ServeDNS(s.t, map[string][]netip.Addr{
		"api.allowed.test": {s.w.Addrs[1]},
		"cdn.allowed.test": {s.w.Addrs[2]},
		"evil.test":        {s.w.Addrs[0]},
	})
	ca := nettest.NewTestCA(s.t, "escape-world")
	cert := ca.Issue(s.t, "api.allowed.test", "cdn.allowed.test", "evil.test")
	s.w.ServeWeb(s.t, func(string) *tls.Certificate { return &cert })
	return up
}

func (s *suite) egressPolicy() policy.Policy {
	no := false
	p, err := policy.Parse("network", policy.Spec{AllowInternet: &no, Allow: []string{"api.allowed.test", "cdn.allowed.test"}})
	if err != nil {
		s.t.Fatal(err)
	}
	return p
}

// egressSpecs: the probe's egress arguments; "egress-allowed" is the path
// every row needs (the allowed name, answered through the proxy).
func (s *suite) egressSpecs() []string {
	api, cdn := s.w.Addrs[1].String(), s.w.Addrs[2].String()
	return []string{"-lookup", "api.allowed.test,cdn.allowed.test",
		"egress-allowed=tls:" + api + ":443:api.allowed.test",
		"egress-forged-sni=tls:" + api + ":443:evil.test",
		"egress-other-addr=tls:" + cdn + ":443:api.allowed.test",
		"egress-ip-literal=tls:" + api + ":443:-",
		"egress-host-header=http:" + api + ":80:evil.test",
		"egress-second-host=http:" + api + ":80:api.allowed.test:evil.test",
	}
}

// setPolicy changes a sandbox's policy through cubelet.
func (s *suite) setPolicy(ctx context.Context, rt string, p policy.Policy) {
	if _, err := s.svc.UpdateNetwork(ctx, s.sbs[rt].ID, p); err != nil {
		s.t.Errorf("[%s] update network: %v", rt, err)
	}
}

// egress runs the egress rows in rt's sandbox under the domain policy,
// then gives it back the default policy.
func (s *suite) egress(ctx context.Context, rt string) {
	s.setPolicy(ctx, rt, s.egressPolicy())
	defer s.setPolicy(ctx, rt, policy.Policy{})
	res, err := s.exec(ctx, rt, time.Minute, nil, append([]string{"egress"}, s.egressSpecs()...)...)
	if err != nil {
		s.t.Errorf("[%s] probe egress: %v", rt, err)
		return
	}
	got := parseLines(res.Stdout)
	l := got["egress-allowed"]
	s.t.Logf("[%s] egress-allowed (the path every egress row needs): %s %s", rt, l.Word, l.Detail)
	if l.Word != "escaped" {
		s.mu.Lock()
		s.netOK[rt]["egress"] = fmt.Sprintf("the allowed name is unreachable through the proxy too (%s; %s)", l.Detail, res.Stderr)
		s.mu.Unlock()
	}
	for _, r := range egressRows {
		l, ok := got[r.Name]
		if !ok {
			s.t.Errorf("[%s] no result for %s: %+v", rt, r.Name, res)
			continue
		}
		s.record(r.Name, rt, l.Word == "escaped", "%s", l.Detail)
	}
}

// egressControl: the same probe from the runc sandbox, same policy, with
// the slot's redirect to the proxy gone: every row gets through.
func (s *suite) egressControl(ctx context.Context) {
	s.setPolicy(ctx, runc, s.egressPolicy())
	defer s.setPolicy(ctx, runc, policy.Policy{})
	err := netnsdir.Do(s.sbs[runc].Network.SlotNetNS, func() error {
		c, err := nftables.New()
		if err != nil {
			return err
		}
		c.FlushSet(&nftables.Set{Table: &nftables.Table{Family: nftables.TableFamilyIPv4, Name: nft.SlotTable}, Name: nft.ProxiedSet})
		return c.Flush()
	})
	if err != nil {
		s.t.Errorf("remove the redirect: %v", err)
	}
	res, err := s.exec(ctx, runc, time.Minute, nil, append([]string{"egress"}, s.egressSpecs()...)...)
	if err != nil {
		s.t.Errorf("egress control: %v", err)
	}
	s.restoreSlot(ctx)
	got := parseLines(res.Stdout)
	for _, r := range egressRows {
		l := got[r.Name]
		s.control(r.Name, l.Word == "escaped", "runc, redirect removed: %s", l.Detail)
	}
}
