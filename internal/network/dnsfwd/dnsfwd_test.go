package dnsfwd

import (
	"crypto/rand"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/cubesandbox/cube/internal/testenv"
)

// serveOn starts a DNS server on addr:53 (UDP) answering every A query
// with ip.
func serveOn(t *testing.T, addr, ip string) {
	t.Helper()
	pc, err := net.ListenPacket("udp4", net.JoinHostPort(addr, "53"))
	if err != nil {
		t.Fatal(err)
	}
	s := &dns.Server{PacketConn: pc, Handler: dns.HandlerFunc(func(w dns.ResponseWriter, r *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(r)
		m.Answer = []dns.RR{&dns.A{Hdr: dns.RR_Header{Name: r.Question[0].Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 5}, A: net.ParseIP(ip)}}
		_ = w.WriteMsg(m)
	})}
	started := make(chan struct{})
	s.NotifyStartedFunc = func() { close(started) }
	go func() { _ = s.ActivateAndServe() }()
	<-started
	t.Cleanup(func() { _ = s.Shutdown() })
}

// TestFollowNodeResolvers: with no upstreams configured the forwarder
// uses the nameservers of the node's resolv.conf, and follows the file
// when it changes.
func TestFollowNodeResolvers(t *testing.T) {
	testenv.RequireRoot(t, "binds port 53 on loopback")
	b := make([]byte, 2)
	_, _ = rand.Read(b)
	a1, a2 := fmt.Sprintf("127.77.%d.%d", b[0], b[1]|1), fmt.Sprintf("127.78.%d.%d", b[0], b[1]|1)
	serveOn(t, a1, "192.0.2.1")
	serveOn(t, a2, "192.0.2.2")
	conf := filepath.Join(t.TempDir(), "resolv.conf")
	if err := os.WriteFile(conf, []byte("nameserver "+a1+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := New(Config{ResolvConf: conf, Timeout: time.Second}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ask := func() string {
		t.Helper()
		q := new(dns.Msg)
		q.SetQuestion("x.test.", dns.TypeA)
		r, err := f.exchange(q, "udp")
		if err != nil || len(r.Answer) != 1 {
			t.Fatalf("exchange: %v %v", r, err)
		}
		return r.Answer[0].(*dns.A).A.String()
	}
	if got := ask(); got != "192.0.2.1" {
		t.Fatalf("first resolver answered %s", got)
	}
	if err := os.WriteFile(conf, []byte("# changed\nnameserver "+a2+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := ask(); got != "192.0.2.2" {
		t.Fatalf("after the node's resolv.conf changed: %s", got)
	}
	// Configured upstreams win over the node's.
	g, err := New(Config{Upstreams: []string{a1}, ResolvConf: conf}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if ups, _ := g.upstreamList(); len(ups) != 1 || ups[0] != a1+":53" {
		t.Fatalf("configured upstreams: %v", ups)
	}
	if _, err := New(Config{Upstreams: []string{"dns.example"}}, nil); err == nil {
		t.Fatal("a name as upstream was accepted")
	}
}

func TestBucket(t *testing.T) {
	b := newBucket(10, 5)
	now := time.Now()
	n := 0
	for range 20 {
		if b.take(now) {
			n++
		}
	}
	if n != 5 {
		t.Fatalf("burst: %d taken, want 5", n)
	}
	if !b.take(now.Add(150 * time.Millisecond)) {
		t.Fatal("no token after 150 ms at 10/s")
	}
	if b.take(now.Add(150 * time.Millisecond)) {
		t.Fatal("a second token after 150 ms at 10/s")
	}
	u := newBucket(0, 0)
	for i := range 100 {
		if !u.take(now) {
			t.Fatalf("rate 0 must be unlimited: refused query %d", i)
		}
	}
}
