// Package dnsfwd is the node's DNS forwarder for sandboxes, run by
// network-agent. It serves every sandbox from sockets opened inside that
// sandbox's slot namespace at the sandbox's gateway address (the same
// address in every slot, 169.254.0.22:53), so:
//
//   - a query's sandbox is known from the socket it arrived on (every
//     sandbox has the same address, so a source address could not tell);
//   - nothing listens in the host namespace, and the slot table's input
//     chain opens exactly UDP and TCP port 53 at that address to the
//     sandbox;
//   - queries to the node's resolvers leave from the agent's own (host)
//     namespace, so a resolver on the node's loopback (systemd-resolved)
//     works as it does for the node.
//
// A query is answered as the sandbox's policy allows (policy.DNSVerdict):
// a name an allow_out domain entry covers is forwarded, and the IPv4
// addresses of the answer are added to the slot's resolved set before the
// answer goes back, so the sandbox's first connection already passes; any
// other name is forwarded only when the sandbox may reach the internet by
// default, and refused (REFUSED) otherwise. Every query is logged with the
// sandbox ID; each sandbox has a query rate limit.
package dnsfwd

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/miekg/dns"
	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/network/audit"
	"github.com/cubesandbox/cube/internal/network/netnsdir"
	"github.com/cubesandbox/cube/internal/network/nft"
	"github.com/cubesandbox/cube/internal/network/policy"
)

// Config is the forwarder's part of network-agent's config.
type Config struct {
	// Upstreams are "host" or "host:port" resolvers, tried in order. Empty:
	// follow the node's resolvers (ResolvConf), re-read when it changes.
	Upstreams  []string
	ResolvConf string
	// Rate and Burst bound each sandbox's queries (per second; a token
	// bucket). Queries over the limit are dropped and counted.
	Rate  float64
	Burst int
	// MinTTL and MaxTTL bound how long an allowed name's addresses stay
	// reachable: the answer's TTL, raised to MinTTL (clients connect
	// after the answer, some cache it briefly past its TTL) and cut to
	// MaxTTL (the answer's TTLs are cut too, so no client caches past it).
	MinTTL, MaxTTL time.Duration
	// Timeout bounds one upstream exchange.
	Timeout time.Duration
	// LogQueries logs one line per query (slog Info, "dns query").
	LogQueries bool
	// Audit, when set, records every query (audit.KindDNS).
	Audit *audit.Log
}

// Stats are the forwarder's counters since start.
type Stats struct {
	Answered, Refused, Limited, Failed, Added atomic.Uint64
}

// Forwarder serves the sandboxes attached to it.
type Forwarder struct {
	cfg   Config
	log   *slog.Logger
	Stats Stats

	upMu      sync.Mutex
	upstreams []string
	upStamp   string // resolv.conf's mtime and size when read

	mu    sync.Mutex
	slots map[string]*sandbox
}

// New returns a forwarder; it serves nothing until Attach.
func New(cfg Config, log *slog.Logger) (*Forwarder, error) {
	if log == nil {
		log = slog.Default()
	}
	if cfg.ResolvConf == "" {
		cfg.ResolvConf = "/etc/resolv.conf"
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 2 * time.Second
	}
	if cfg.MaxTTL < cfg.MinTTL {
		return nil, fmt.Errorf("dns: max_ttl %s is below min_ttl %s", cfg.MaxTTL, cfg.MinTTL)
	}
	f := &Forwarder{cfg: cfg, log: log, slots: map[string]*sandbox{}}
	for _, u := range cfg.Upstreams {
		hp, err := hostPort(u)
		if err != nil {
			return nil, err
		}
		f.upstreams = append(f.upstreams, hp)
	}
	if len(f.upstreams) == 0 {
		// Not fatal: the node's resolvers may appear later (the file is
		// re-read on change); until then every query is SERVFAIL.
		if _, err := f.upstreamList(); err != nil {
			log.Warn("dns: no upstream resolvers yet", "err", err)
		}
	}
	return f, nil
}

func hostPort(s string) (string, error) {
	if ap, err := netip.ParseAddrPort(s); err == nil {
		return ap.String(), nil
	}
	if a, err := netip.ParseAddr(s); err == nil {
		return net.JoinHostPort(a.String(), "53"), nil
	}
	return "", fmt.Errorf("dns upstream %q: want an IP address or address:port", s)
}

// Target is one sandbox to serve.
type Target struct {
	SandboxID string
	// NetNS is the slot namespace; Addr the address to listen on there.
	NetNS  string
	Addr   netip.Addr
	Policy policy.Policy
}

// sandbox is one attached sandbox: its sockets, policy, limiter and the
// addresses its allowed names resolved to.
type sandbox struct {
	id     string
	netns  string
	nsFile *os.File // held open for nft calls into the namespace
	udp    *dns.Server
	tcp    *dns.Server
	policy atomic.Pointer[policy.Policy]
	limit  *bucket

	mu       sync.Mutex
	resolved map[netip.Addr]entry
	full     bool // the resolved set was full at the last add (logged once)
}

// entry is an address and the names (lowercase, no trailing dot) that
// resolved to it, with when it stops being reachable.
type entry struct {
	names   []string
	expires time.Time
}

// Attach starts serving t. Attaching a sandbox already served at the same
// namespace only sets its policy (as SetPolicy); at another namespace it
// is detached first.
func (f *Forwarder) Attach(t Target) error {
	f.mu.Lock()
	cur := f.slots[t.SandboxID]
	f.mu.Unlock()
	if cur != nil {
		if cur.netns == t.NetNS {
			return f.SetPolicy(t.SandboxID, t.Policy)
		}
		f.Detach(t.SandboxID)
	}
	s := &sandbox{id: t.SandboxID, netns: t.NetNS, limit: newBucket(f.cfg.Rate, f.cfg.Burst), resolved: map[netip.Addr]entry{}}
	p := t.Policy.Clone()
	s.policy.Store(&p)
	nsf, err := os.Open(t.NetNS)
	if err != nil {
		return fmt.Errorf("dns: sandbox %s: %w", t.SandboxID, err)
	}
	s.nsFile = nsf
	var pc net.PacketConn
	var ln net.Listener
	addr := net.JoinHostPort(t.Addr.String(), strconv.Itoa(nft.DNSPort))
	// IP_FREEBIND: a VM slot's TAP has the address but no carrier until
	// the VM monitor opens it; the socket must bind all the same.
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_FREEBIND, 1)
		}); err != nil {
			return err
		}
		return serr
	}}
	err = netnsdir.Do(t.NetNS, func() error {
		var err error
		if pc, err = lc.ListenPacket(context.Background(), "udp4", addr); err != nil {
			return err
		}
		if ln, err = lc.Listen(context.Background(), "tcp4", addr); err != nil {
			pc.Close()
			return err
		}
		return nil
	})
	if err != nil {
		nsf.Close()
		return fmt.Errorf("dns: sandbox %s: listen in %s: %w", t.SandboxID, t.NetNS, err)
	}
	h := dns.HandlerFunc(func(w dns.ResponseWriter, r *dns.Msg) { f.serve(s, w, r) })
	s.udp = &dns.Server{PacketConn: pc, Handler: h}
	s.tcp = &dns.Server{Listener: ln, Handler: h, ReadTimeout: 5 * time.Second, IdleTimeout: func() time.Duration { return 10 * time.Second }}
	for _, srv := range []*dns.Server{s.udp, s.tcp} {
		go func() {
			if err := srv.ActivateAndServe(); err != nil {
				f.log.Debug("dns server stopped", "sandbox_id", s.id, "err", err)
			}
		}()
	}
	f.mu.Lock()
	f.slots[t.SandboxID] = s
	f.mu.Unlock()
	return nil
}

// Detach stops serving a sandbox (nothing when it is not served).
func (f *Forwarder) Detach(id string) {
	f.mu.Lock()
	s := f.slots[id]
	delete(f.slots, id)
	f.mu.Unlock()
	if s != nil {
		s.close()
	}
}

func (s *sandbox) close() {
	for _, srv := range []*dns.Server{s.udp, s.tcp} {
		// Shutdown fails only for a server that never started: close
		// its socket directly then.
		if err := srv.Shutdown(); err != nil {
			if srv.PacketConn != nil {
				srv.PacketConn.Close()
			}
			if srv.Listener != nil {
				srv.Listener.Close()
			}
		}
	}
	s.nsFile.Close()
}

// Close detaches every sandbox.
func (f *Forwarder) Close() {
	f.mu.Lock()
	all := f.slots
	f.slots = map[string]*sandbox{}
	f.mu.Unlock()
	for _, s := range all {
		s.close()
	}
}

// Attached lists the sandboxes served.
func (f *Forwarder) Attached() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]string, 0, len(f.slots))
	for id := range f.slots {
		out = append(out, id)
	}
	slices.Sort(out)
	return out
}

// SetPolicy changes the policy a sandbox's queries are decided by. When
// its domain entries change, the resolved set keeps only the addresses of
// names the new policy still allows (one transaction): an address learnt
// for a name no longer allowed stops being reachable at once (the caller
// then drops the sandbox's conntrack entries, which cuts connections
// already open to it). Addresses whose names the forwarder does not know
// (resolved before an agent restart) are dropped too: the sandbox
// resolves them again.
func (f *Forwarder) SetPolicy(id string, p policy.Policy) error {
	f.mu.Lock()
	s := f.slots[id]
	f.mu.Unlock()
	if s == nil {
		return fmt.Errorf("dns: sandbox %s is not attached", id)
	}
	p = p.Clone()
	old := s.policy.Swap(&p)
	if old != nil && slices.Equal(old.AllowDomains, p.AllowDomains) {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	var keep []nft.Resolved
	for a, e := range s.resolved {
		still := slices.ContainsFunc(e.names, func(n string) bool { _, ok := policy.MatchDomain(p.AllowDomains, n); return ok })
		if !still || !e.expires.After(now) {
			delete(s.resolved, a)
			continue
		}
		keep = append(keep, nft.Resolved{Addr: a, Timeout: e.expires.Sub(now).Round(time.Second) + time.Second})
	}
	if err := nft.PruneResolved(int(s.nsFile.Fd()), keep); err != nil {
		return fmt.Errorf("dns: sandbox %s: %w", id, err)
	}
	return nil
}

// serve answers one query of sandbox s.
func (f *Forwarder) serve(s *sandbox, w dns.ResponseWriter, r *dns.Msg) {
	start := time.Now()
	if !s.limit.take(start) {
		f.Stats.Limited.Add(1)
		if s.limit.warn(start) {
			f.log.Warn("dns query rate limit", "sandbox_id", s.id, "rate", f.cfg.Rate, "burst", f.cfg.Burst)
		}
		if w.RemoteAddr().Network() == "tcp" {
			w.Close()
		}
		return
	}
	m := new(dns.Msg)
	if r.Opcode != dns.OpcodeQuery || len(r.Question) != 1 {
		m.SetRcode(r, dns.RcodeNotImplemented)
		_ = w.WriteMsg(m)
		return
	}
	q := r.Question[0]
	p := s.policy.Load()
	answer, rule := p.DNSVerdict(q.Name)
	verdict := "refused"
	var resp *dns.Msg
	var added int
	var err error
	if answer {
		verdict = "forwarded"
		resp, err = f.exchange(r, w.RemoteAddr().Network())
		if err == nil && rule != "" {
			verdict = "allowed"
			added, err = f.learn(s, q.Name, resp)
		}
	}
	switch {
	case !answer:
		f.Stats.Refused.Add(1)
		m.SetRcode(r, dns.RcodeRefused)
		resp = m
	case err != nil:
		f.Stats.Failed.Add(1)
		verdict = "failed"
		m.SetRcode(r, dns.RcodeServerFailure)
		resp = m
	default:
		f.Stats.Answered.Add(1)
		resp.Id = r.Id
	}
	if werr := w.WriteMsg(resp); werr != nil && err == nil {
		err = werr
	}
	if f.cfg.Audit != nil {
		ev := audit.Event{SandboxID: s.id, Kind: audit.KindDNS, Verdict: audit.Allowed, Name: strings.TrimSuffix(strings.ToLower(q.Name), "."),
			QType: dns.TypeToString[q.Qtype], RCode: dns.RcodeToString[resp.Rcode], Rule: rule,
			DurationMS: float64(time.Since(start).Microseconds()) / 1000}
		switch verdict {
		case "refused":
			ev.Verdict, ev.Reason = audit.Denied, "name not allowed by the policy"
		case "failed":
			ev.Verdict = audit.Failed
		}
		for _, rr := range resp.Answer {
			if a, ok := rr.(*dns.A); ok {
				ev.Addrs = append(ev.Addrs, a.A.String())
			}
		}
		f.cfg.Audit.Write(ev)
	}
	if f.cfg.LogQueries || err != nil {
		attrs := []any{"sandbox_id", s.id, "name", q.Name, "type", dns.TypeToString[q.Qtype],
			"verdict", verdict, "rcode", dns.RcodeToString[resp.Rcode], "answers", len(resp.Answer),
			"duration", time.Since(start)}
		if rule != "" {
			attrs = append(attrs, "rule", rule, "added", added)
		}
		if err != nil {
			attrs = append(attrs, "err", err)
		}
		f.log.Info("dns query", attrs...)
	}
}

// exchange forwards r to the upstreams in order until one answers. An
// answer truncated over UDP is retried over TCP when the sandbox asked
// over TCP; over UDP the truncated answer goes back (the client retries
// over TCP itself).
func (f *Forwarder) exchange(r *dns.Msg, network string) (*dns.Msg, error) {
	ups, err := f.upstreamList()
	if err != nil {
		return nil, err
	}
	q := r.Copy()
	q.Id = dns.Id()
	var errs []error
	for _, up := range ups {
		c := &dns.Client{Net: "udp", Timeout: f.cfg.Timeout}
		resp, _, err := c.Exchange(q, up)
		if err == nil && resp.Truncated && network == "tcp" {
			c.Net = "tcp"
			resp, _, err = c.Exchange(q, up)
		}
		if err == nil {
			return resp, nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", up, err))
	}
	return nil, fmt.Errorf("no upstream answered: %w", errors.Join(errs...))
}

// upstreamList returns the configured upstreams, or the node's current
// resolvers (resolv.conf is re-read when its mtime or size changes).
func (f *Forwarder) upstreamList() ([]string, error) {
	if len(f.cfg.Upstreams) > 0 {
		return f.upstreams, nil
	}
	st, err := os.Stat(f.cfg.ResolvConf)
	if err != nil {
		return nil, fmt.Errorf("node resolvers: %w", err)
	}
	stamp := st.ModTime().String() + "/" + strconv.FormatInt(st.Size(), 10)
	f.upMu.Lock()
	defer f.upMu.Unlock()
	if stamp == f.upStamp {
		return f.upstreams, nil
	}
	cc, err := dns.ClientConfigFromFile(f.cfg.ResolvConf)
	if err != nil {
		return nil, fmt.Errorf("node resolvers: %w", err)
	}
	var ups []string
	for _, s := range cc.Servers {
		ups = append(ups, net.JoinHostPort(s, cc.Port))
	}
	if len(ups) == 0 {
		return nil, fmt.Errorf("node resolvers: %s names no nameserver", f.cfg.ResolvConf)
	}
	f.upstreams, f.upStamp = ups, stamp
	f.log.Info("dns upstreams", "from", f.cfg.ResolvConf, "servers", ups)
	return ups, nil
}

// learn adds the IPv4 addresses of an allowed name's answer to the
// sandbox's resolved set, before the answer is sent. TTLs in the answer
// are cut to MaxTTL so that no client caches an address past the time it
// stays reachable.
func (f *Forwarder) learn(s *sandbox, name string, resp *dns.Msg) (int, error) {
	if resp.Rcode != dns.RcodeSuccess {
		return 0, nil
	}
	maxTTL := uint32(f.cfg.MaxTTL / time.Second)
	var add []nft.Resolved
	now := time.Now()
	for _, rr := range resp.Answer {
		if h := rr.Header(); maxTTL > 0 && h.Ttl > maxTTL {
			h.Ttl = maxTTL
		}
		a, ok := rr.(*dns.A)
		if !ok {
			continue
		}
		addr, ok := netip.AddrFromSlice(a.A.To4())
		if !ok {
			continue
		}
		ttl := time.Duration(a.Hdr.Ttl) * time.Second
		ttl = max(ttl, f.cfg.MinTTL)
		if f.cfg.MaxTTL > 0 {
			ttl = min(ttl, f.cfg.MaxTTL)
		}
		add = append(add, nft.Resolved{Addr: addr, Timeout: ttl})
	}
	if len(add) == 0 {
		return 0, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := nft.AddResolved(int(s.nsFile.Fd()), add); err != nil {
		if !s.full {
			s.full = true
			f.log.Warn("dns: cannot add resolved addresses (set full?)", "sandbox_id", s.id, "err", err)
		}
		return 0, err
	}
	s.full = false
	n := strings.TrimSuffix(strings.ToLower(name), ".")
	for _, r := range add {
		e := s.resolved[r.Addr]
		if !slices.Contains(e.names, n) {
			e.names = append(e.names, n)
		}
		if exp := now.Add(r.Timeout); exp.After(e.expires) {
			e.expires = exp
		}
		s.resolved[r.Addr] = e
	}
	if len(s.resolved) > nft.ResolvedSetSize {
		for a, e := range s.resolved {
			if !e.expires.After(now) {
				delete(s.resolved, a)
			}
		}
	}
	f.Stats.Added.Add(uint64(len(add)))
	return len(add), nil
}

// Resolved reports whether the forwarder answered name with addr to
// sandbox id, for a name the sandbox's policy allows, and the answer has
// not expired: what the egress proxy checks a connection's destination
// against.
func (f *Forwarder) Resolved(id, name string, addr netip.Addr) bool {
	f.mu.Lock()
	s := f.slots[id]
	f.mu.Unlock()
	if s == nil {
		return false
	}
	name = strings.TrimSuffix(strings.ToLower(name), ".")
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.resolved[addr]
	return ok && e.expires.After(time.Now()) && slices.Contains(e.names, name)
}

// NamesAt returns the names the forwarder answered with addr to sandbox
// id whose answers have not expired: how the egress proxy finds that a
// connection goes to an address of a host with request rules given by a
// wildcard.
func (f *Forwarder) NamesAt(id string, addr netip.Addr) []string {
	f.mu.Lock()
	s := f.slots[id]
	f.mu.Unlock()
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.resolved[addr]
	if !ok || !e.expires.After(time.Now()) {
		return nil
	}
	return slices.Clone(e.names)
}

// LookupA resolves name's IPv4 addresses through the forwarder's
// upstreams (the node's resolvers): the egress proxy's second check when
// the sandbox found an address some other way (its own cache, a hosts
// file) — the address must still be one of the name's.
func (f *Forwarder) LookupA(ctx context.Context, name string) ([]netip.Addr, error) {
	q := new(dns.Msg)
	q.SetQuestion(dns.Fqdn(name), dns.TypeA)
	q.RecursionDesired = true
	type result struct {
		m   *dns.Msg
		err error
	}
	ch := make(chan result, 1)
	go func() {
		m, err := f.exchange(q, "udp")
		ch <- result{m, err}
	}()
	var r result
	select {
	case r = <-ch:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	if r.err != nil {
		return nil, r.err
	}
	if r.m.Rcode != dns.RcodeSuccess {
		return nil, fmt.Errorf("%s: %s", name, dns.RcodeToString[r.m.Rcode])
	}
	var out []netip.Addr
	for _, rr := range r.m.Answer {
		if a, ok := rr.(*dns.A); ok {
			if ip, ok := netip.AddrFromSlice(a.A.To4()); ok {
				out = append(out, ip)
			}
		}
	}
	return out, nil
}
