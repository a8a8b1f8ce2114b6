package main

import (
	"crypto/rand"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/miekg/dns"
)

// resolver is the test resolver of domain mode: a DNS server on port 53 of
// a random loopback address that answers <domain> and every name under it
// with 127.0.0.1 (no AAAA), and passes every other name on to the
// machine's own nameservers (the command still installs packages from
// the registries). The command runs
// in a private mount namespace whose /etc/resolv.conf names only it, so
// the SDKs resolve https://api.<domain> and https://<port>-<id>.<domain>
// through the system's own resolver (getaddrinfo) without a line in the
// shared /etc/hosts.
type resolver struct {
	addr       string
	resolvConf string
	servers    []*dns.Server
}

func startResolver(dir, domain string) (*resolver, error) {
	if h, _, err := net.SplitHostPort(domain); err == nil {
		domain = h
	}
	zone := dns.Fqdn(strings.ToLower(domain))
	var upstream []string
	if cc, err := dns.ClientConfigFromFile("/etc/resolv.conf"); err == nil {
		for _, s := range cc.Servers {
			upstream = append(upstream, net.JoinHostPort(s, cc.Port))
		}
	}
	inZone := func(name string) bool {
		name = strings.ToLower(name)
		return name == zone || strings.HasSuffix(name, "."+zone)
	}
	handler := dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
		if len(q.Question) > 0 && !inZone(q.Question[0].Name) {
			_ = w.WriteMsg(forward(q, upstream, w.RemoteAddr().Network()))
			return
		}
		m := new(dns.Msg)
		m.SetReply(q)
		m.Authoritative = true
		for _, qq := range q.Question {
			if qq.Qtype == dns.TypeA {
				m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: qq.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 5}, A: net.IPv4(127, 0, 0, 1)})
			}
		}
		_ = w.WriteMsg(m)
	})
	var lastErr error
	for range 20 {
		b := make([]byte, 3)
		_, _ = rand.Read(b)
		ip := net.IPv4(127, b[0]|1, b[1], b[2]|1).String()
		addr := net.JoinHostPort(ip, "53")
		pc, err := net.ListenPacket("udp", addr)
		if err != nil {
			lastErr = err
			continue
		}
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			pc.Close()
			lastErr = err
			continue
		}
		r := &resolver{addr: ip, resolvConf: filepath.Join(dir, "resolv.conf")}
		r.servers = []*dns.Server{{PacketConn: pc, Handler: handler}, {Listener: ln, Handler: handler}}
		for _, s := range r.servers {
			go func() { _ = s.ActivateAndServe() }()
		}
		if err := os.WriteFile(r.resolvConf, []byte("nameserver "+ip+"\noptions attempts:2 timeout:1\n"), 0o644); err != nil {
			r.stop()
			return nil, err
		}
		return r, nil
	}
	return nil, fmt.Errorf("test resolver: no loopback address to serve DNS on: %w", lastErr)
}

// forward asks the upstream nameservers in turn; SERVFAIL when none
// answers.
func forward(q *dns.Msg, upstream []string, network string) *dns.Msg {
	c := &dns.Client{Net: network, Timeout: 2 * time.Second}
	for _, u := range upstream {
		if r, _, err := c.Exchange(q, u); err == nil {
			return r
		}
	}
	m := new(dns.Msg)
	m.SetRcode(q, dns.RcodeServerFailure)
	return m
}

func (r *resolver) stop() {
	for _, s := range r.servers {
		_ = s.Shutdown()
	}
}

// wrap returns command run in a private mount namespace whose
// /etc/resolv.conf is the resolver's (util-linux unshare; the namespace
// and the bind mount go with the process).
func (r *resolver) wrap(command []string) []string {
	return append([]string{"unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
		`mount --bind "$0" /etc/resolv.conf && exec "$@"`, r.resolvConf}, command...)
}
