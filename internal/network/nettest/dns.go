package nettest

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/cubesandbox/cube/internal/network/netnsdir"
)

// DNSTTL is the TTL of every record the world's DNS server gives.
const DNSTTL = 30

// ServeDNS starts an authoritative DNS server in the world, on UDP and
// TCP port 53 of its first address, answering A queries for the names in
// records (any case, with or without the trailing dot) and NXDOMAIN for
// every other name. It returns the server's address (what a test agent's
// [dns] upstreams names); it stops on t's cleanup.
func (w *World) ServeDNS(t testing.TB, records map[string][]netip.Addr) netip.AddrPort {
	t.Helper()
	zone := map[string][]netip.Addr{}
	for n, as := range records {
		zone[dns.Fqdn(strings.ToLower(n))] = as
	}
	h := dns.HandlerFunc(func(rw dns.ResponseWriter, r *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(r)
		m.Authoritative = true
		if len(r.Question) != 1 {
			m.Rcode = dns.RcodeFormatError
			_ = rw.WriteMsg(m)
			return
		}
		q := r.Question[0]
		as, ok := zone[strings.ToLower(q.Name)]
		if !ok {
			m.Rcode = dns.RcodeNameError
		}
		if q.Qtype == dns.TypeA {
			for _, a := range as {
				m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: DNSTTL}, A: net.IP(a.AsSlice())})
			}
		}
		_ = rw.WriteMsg(m)
	})
	ap := netip.AddrPortFrom(w.Addrs[0], 53)
	var pc net.PacketConn
	var ln net.Listener
	err := netnsdir.Do(w.NS, func() error {
		var err error
		if pc, err = net.ListenPacket("udp4", ap.String()); err != nil {
			return err
		}
		ln, err = net.Listen("tcp4", ap.String())
		return err
	})
	if err != nil {
		t.Fatalf("world dns: %v", err)
	}
	for _, s := range []*dns.Server{{PacketConn: pc, Handler: h}, {Listener: ln, Handler: h}} {
		started := make(chan struct{})
		s.NotifyStartedFunc = func() { close(started) }
		go func() { _ = s.ActivateAndServe() }()
		<-started
		t.Cleanup(func() { _ = s.Shutdown() })
	}
	return ap
}

// Answer is what a Resolve got.
type Answer struct {
	Rcode int
	Addrs []netip.Addr
	TTLs  []uint32
}

// Resolve sends an A query for name from inside the namespace nsPath
// ("" = the host) to server over network ("udp" or "tcp").
func Resolve(ctx context.Context, nsPath string, server netip.AddrPort, network, name string, wait time.Duration) (Answer, error) {
	var ans Answer
	in := func(fn func() error) error { return netnsdir.Do(nsPath, fn) }
	if nsPath == "" {
		in = func(fn func() error) error { return fn() }
	}
	err := in(func() error {
		c := &dns.Client{Net: network, Timeout: wait}
		m := new(dns.Msg)
		m.SetQuestion(dns.Fqdn(name), dns.TypeA)
		// The dial happens on this (namespace) thread.
		r, _, err := c.ExchangeContext(ctx, m, server.String())
		if err != nil {
			return err
		}
		ans.Rcode = r.Rcode
		for _, rr := range r.Answer {
			if a, ok := rr.(*dns.A); ok {
				addr, _ := netip.AddrFromSlice(a.A.To4())
				ans.Addrs = append(ans.Addrs, addr)
				ans.TTLs = append(ans.TTLs, a.Hdr.Ttl)
			}
		}
		return nil
	})
	return ans, err
}

// String is the answer for logs.
func (a Answer) String() string {
	return fmt.Sprintf("%s %v", dns.RcodeToString[a.Rcode], a.Addrs)
}
