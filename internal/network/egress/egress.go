// Package egress is the node's egress proxy, run by network-agent beside
// the DNS forwarder. It serves every sandbox from a listener opened inside
// that sandbox's slot namespace at the sandbox's gateway
// (169.254.0.22:<port>); the slot table redirects the sandbox's new TCP
// connections to ports 80 and 443 there when its policy is Proxied
// (domain entries without default internet, or credential or request
// rules). So:
//
//   - a connection's sandbox is known from the listener it arrived on, and
//     its original destination from the redirect (SO_ORIGINAL_DST);
//   - the proxy reads the name the connection claims (TLS SNI without
//     terminating TLS, or the HTTP Host of every request) and decides by
//     the policy, with the destination checked against that name's
//     addresses (see decide); a denied connection is reset;
//   - for a host with credential rules it terminates TLS with a
//     certificate from the node's egress CA, opens its own TLS connection
//     to the upstream (verified against the node's roots), and adds the
//     rules' headers to every request: the secret never enters the
//     sandbox; a host with request rules is terminated the same way and
//     each request must match one of them (method, path), or the proxy
//     answers it 403 and ends the connection; a connection to an address
//     of a host with request rules is bound to them whatever it names
//     (ruleHostAt): it must name one of the address's names, is
//     terminated, and each request's Host must be that name;
//   - upstream connections leave from the agent's own (host) namespace;
//   - a policy update re-decides every open connection and cuts those the
//     new policy denies;
//   - every decision is an audit event (package audit).
//
// Should the agent die, the listeners die with it: redirected connections
// are refused, so domain-restricted sandboxes fail closed.
package egress

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/network/audit"
	"github.com/cubesandbox/cube/internal/network/netnsdir"
	"github.com/cubesandbox/cube/internal/network/policy"
)

// Config is the proxy's part of network-agent's config.
type Config struct {
	// Port is where the proxy listens in every slot namespace.
	Port     uint16
	NodeCIDR netip.Prefix
	// Opened are the private ranges the node lets policies open.
	Opened []netip.Prefix
	// CA signs the certificates of terminated hosts; nil: no credential
	// injection (a connection to a credential host is refused rather than
	// sent without its credential).
	CA *CA
	// UpstreamRoots verify upstream servers when TLS is terminated; nil:
	// the system's roots.
	UpstreamRoots *x509.CertPool
	// DialTimeout bounds an upstream connect; PeekTimeout how long a
	// sandbox has to send its ClientHello or request head; IdleTimeout
	// how long a kept-alive HTTP connection waits for its next request;
	// LookupTimeout one check of a name's addresses with the node's
	// resolvers.
	DialTimeout, PeekTimeout, IdleTimeout, LookupTimeout time.Duration
	Audit                                                *audit.Log
}

// Stats are the proxy's counters since start.
type Stats struct {
	Allowed, Denied, Cut, Terminated, Failed atomic.Uint64
}

// Proxy serves the sandboxes attached to it.
type Proxy struct {
	cfg       Config
	log       *slog.Logger
	res       Resolver
	blocked   []netip.Prefix
	hostAddrs localAddrs
	Stats     Stats
	lookups   struct {
		sync.Mutex
		m map[string]cachedLookup
	}

	mu    sync.Mutex
	slots map[string]*sandbox
}

// New returns a proxy; it serves nothing until Attach.
func New(cfg Config, res Resolver, blocked []netip.Prefix, log *slog.Logger) *Proxy {
	if log == nil {
		log = slog.Default()
	}
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = 10 * time.Second
	}
	if cfg.PeekTimeout <= 0 {
		cfg.PeekTimeout = 10 * time.Second
	}
	if cfg.IdleTimeout <= 0 {
		cfg.IdleTimeout = 2 * time.Minute
	}
	if cfg.LookupTimeout <= 0 {
		cfg.LookupTimeout = 3 * time.Second
	}
	return &Proxy{cfg: cfg, log: log, res: res, blocked: blocked, slots: map[string]*sandbox{},
		hostAddrs: localAddrs{refresh: 2 * time.Second}}
}

// Target is one sandbox to serve.
type Target struct {
	SandboxID string
	NetNS     string     // the slot namespace
	Addr      netip.Addr // where to listen there
	Policy    policy.Policy
}

type sandbox struct {
	id, netns string
	ln        net.Listener
	policy    atomic.Pointer[policy.Policy]
	ctx       context.Context
	cancel    context.CancelFunc
	wg        sync.WaitGroup

	mu    sync.Mutex
	conns map[*conn]struct{}
}

// conn is one proxied connection, tracked so a policy update can cut it.
type conn struct {
	name   string
	dst    netip.AddrPort
	client net.Conn
	// decided: name and dst are set and the connection was allowed; until
	// then a policy update leaves it to serve, which reads the policy
	// after it.
	decided atomic.Bool
	// creds are the credential rules the connection was served with (set
	// before decided): a policy update that changes them for its name
	// cuts it, so a removed or rotated value is not injected on.
	creds []policy.Credential
	reqs  []policy.RequestRule
	// allReqs: the policy's request rules (every host's) when decided; a
	// change cuts the connection, which may have been bound to a rule
	// host by its address (bound) or not.
	allReqs []policy.RequestRule
	mu      sync.Mutex
	up      net.Conn
	cut     atomic.Bool
}

func (c *conn) setUpstream(u net.Conn) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cut.Load() {
		return false
	}
	c.up = u
	return true
}

func (c *conn) close() {
	c.mu.Lock()
	up := c.up
	c.mu.Unlock()
	reset(c.client)
	if up != nil {
		up.Close()
	}
}

// closeGracefully half-closes c, waits up to a second for the client to
// close its side (reading what it still sends), then closes it.
func closeGracefully(c *net.TCPConn) {
	_ = c.CloseWrite()
	_ = c.SetReadDeadline(time.Now().Add(time.Second))
	_, _ = io.Copy(io.Discard, io.LimitReader(c, 64<<10))
	c.Close()
}

// reset closes c with a TCP RST, so the sandbox sees a refusal at once.
func reset(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	c.Close()
}

// Attach starts serving t (only the policy changes when t is served at
// the same namespace already).
func (p *Proxy) Attach(t Target) error {
	p.mu.Lock()
	cur := p.slots[t.SandboxID]
	p.mu.Unlock()
	if cur != nil {
		if cur.netns == t.NetNS {
			p.SetPolicy(t.SandboxID, t.Policy)
			return nil
		}
		p.Detach(t.SandboxID)
	}
	addr := net.JoinHostPort(t.Addr.String(), strconv.Itoa(int(p.cfg.Port)))
	// IP_FREEBIND: a VM slot's TAP has no carrier until its monitor opens it.
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_FREEBIND, 1)
		}); err != nil {
			return err
		}
		return serr
	}}
	var ln net.Listener
	err := netnsdir.Do(t.NetNS, func() error {
		var err error
		ln, err = lc.Listen(context.Background(), "tcp4", addr)
		return err
	})
	if err != nil {
		return fmt.Errorf("egress: sandbox %s: listen in %s: %w", t.SandboxID, t.NetNS, err)
	}
	s := &sandbox{id: t.SandboxID, netns: t.NetNS, ln: ln, conns: map[*conn]struct{}{}}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	pol := t.Policy.Clone()
	s.policy.Store(&pol)
	p.mu.Lock()
	if other := p.slots[t.SandboxID]; other != nil {
		// Another Attach of this sandbox won the race: its listener
		// serves; this one goes.
		p.mu.Unlock()
		s.cancel()
		ln.Close()
		if other.netns != t.NetNS {
			return fmt.Errorf("egress: sandbox %s: attached concurrently in %s and %s: %w", t.SandboxID, other.netns, t.NetNS, errdefs.ErrAborted)
		}
		p.SetPolicy(t.SandboxID, t.Policy)
		return nil
	}
	p.slots[t.SandboxID] = s
	p.mu.Unlock()
	s.wg.Go(func() { p.acceptLoop(s) })
	return nil
}

// Detach stops serving a sandbox and closes its connections.
func (p *Proxy) Detach(id string) {
	p.mu.Lock()
	s := p.slots[id]
	delete(p.slots, id)
	p.mu.Unlock()
	if s != nil {
		s.close()
	}
}

func (s *sandbox) close() {
	s.cancel()
	s.ln.Close()
	s.mu.Lock()
	for c := range s.conns {
		c.close()
	}
	s.mu.Unlock()
	s.wg.Wait()
}

// Close detaches every sandbox.
func (p *Proxy) Close() {
	p.mu.Lock()
	all := p.slots
	p.slots = map[string]*sandbox{}
	p.mu.Unlock()
	for _, s := range all {
		s.close()
	}
}

// Attached lists the sandboxes served.
func (p *Proxy) Attached() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]string, 0, len(p.slots))
	for id := range p.slots {
		out = append(out, id)
	}
	slices.Sort(out)
	return out
}

// SetPolicy changes a sandbox's policy and cuts its open connections that
// the new policy denies; it returns how many it cut.
func (p *Proxy) SetPolicy(id string, pol policy.Policy) int {
	p.mu.Lock()
	s := p.slots[id]
	p.mu.Unlock()
	if s == nil {
		return 0
	}
	pol = pol.Clone()
	s.policy.Store(&pol)
	s.mu.Lock()
	open := make([]*conn, 0, len(s.conns))
	for c := range s.conns {
		if c.decided.Load() {
			open = append(open, c)
		}
	}
	s.mu.Unlock()
	cut := 0
	for _, c := range open {
		d := p.decide(s.ctx, id, pol, c.dst.Addr(), c.name)
		if d.allow {
			if slices.Equal(pol.CredentialsFor(c.name), c.creds) && policy.RequestRulesEqual(pol.Requests, c.allReqs) {
				continue
			}
			// Still allowed, but served with credentials or request
			// rules the policy no longer gives: a terminated
			// keep-alive connection would inject them on, and one
			// passed through unterminated cannot be filtered.
			d.allow, d.reason = false, "its credential or request rules changed"
		}
		c.mu.Lock()
		c.cut.Store(true)
		c.mu.Unlock()
		c.close()
		cut++
		p.Stats.Cut.Add(1)
		p.cfg.Audit.Write(audit.Event{SandboxID: id, Kind: audit.KindCut, Verdict: audit.Denied, Name: c.name,
			Addr: c.dst.String(), Reason: "policy update: " + d.reason})
	}
	return cut
}

func (p *Proxy) acceptLoop(s *sandbox) {
	for {
		c, err := s.ln.Accept()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				p.log.Warn("egress: accept", "sandbox_id", s.id, "err", err)
			}
			return
		}
		// Tracked from the start, so that Detach closes a connection
		// still being read (not only decided ones).
		tc := &conn{client: c}
		s.mu.Lock()
		s.conns[tc] = struct{}{}
		s.mu.Unlock()
		s.wg.Go(func() {
			defer func() {
				s.mu.Lock()
				delete(s.conns, tc)
				s.mu.Unlock()
				tc.close()
			}()
			p.serve(s, tc)
		})
	}
}

// serve carries one redirected connection.
func (p *Proxy) serve(s *sandbox, c *conn) {
	client := c.client.(*net.TCPConn)
	start := time.Now()
	ev := audit.Event{SandboxID: s.id, Kind: audit.KindConnect}
	dst, err := originalDst(client)
	if err != nil {
		reset(client)
		p.Stats.Failed.Add(1)
		ev.Verdict, ev.Reason = audit.Failed, err.Error()
		p.cfg.Audit.Write(ev)
		return
	}
	ev.Addr = dst.String()
	cc := &countConn{Conn: client}
	_ = client.SetReadDeadline(time.Now().Add(p.cfg.PeekTimeout))
	head := &headLimit{r: cc}
	head.limit(maxHello)
	br := bufio.NewReader(head)
	var hello []byte // the ClientHello, replayed upstream or to our TLS server
	var req *http.Request
	first, err := br.Peek(1)
	if err == nil && first[0] == 0x16 { // a TLS handshake record
		ev.Mode = "sni"
		ev.Name, hello, err = peekSNI(br)
	} else if err == nil {
		ev.Mode = "http"
		head.limit(MaxRequestHead)
		if req, err = http.ReadRequest(br); err == nil {
			ev.Name = hostOnly(req.Host)
		} else if head.hit() {
			refuseHead(cc)
			err = errHeadTooLarge
		}
	}
	head.unlimited()
	if err != nil {
		if errors.Is(err, errHeadTooLarge) {
			closeGracefully(client) // after its 431
		} else {
			reset(client)
		}
		p.Stats.Failed.Add(1)
		ev.Verdict, ev.Reason = audit.Failed, "reading the connection's name: "+err.Error()
		p.cfg.Audit.Write(ev)
		return
	}
	_ = client.SetReadDeadline(time.Time{})
	pp := s.policy.Load()
	pol := *pp
	d := p.decide(s.ctx, s.id, pol, dst.Addr(), ev.Name)
	ev.Rule = d.rule
	creds, reqs := pol.CredentialsFor(ev.Name), pol.RequestRulesFor(ev.Name)
	// strict: the connection is served under request rules: those of its
	// name, or, when its address is one of a rule host's, bound to them:
	// it must name a host that address belongs to (a forged SNI, none,
	// or an IP literal would reach the rule host unchecked) and every
	// request must name that host.
	strict := len(reqs) > 0
	if d.allow && !strict {
		if h := p.ruleHostAt(s.ctx, s.id, pol, dst.Addr()); h != "" {
			strict = true
			if ev.Name == "" || !p.belongs(s.ctx, s.id, ev.Name, dst.Addr()) {
				d = decision{reason: fmt.Sprintf("address of %s, which has request rules, and the connection's name %q is not one of its names",
					h, ev.Name)}
			}
		}
	}
	terminate := len(creds) > 0 || strict
	if d.allow && terminate && p.cfg.CA == nil {
		d = decision{reason: "credential and request rules need the egress CA, which this node has not"}
	}
	if !d.allow {
		reset(client)
		p.Stats.Denied.Add(1)
		ev.Verdict, ev.Reason = audit.Denied, d.reason
		ev.DurationMS = ms(time.Since(start))
		p.cfg.Audit.Write(ev)
		return
	}
	c.name, c.dst, c.creds, c.reqs, c.allReqs = ev.Name, dst, creds, reqs, pol.Requests
	c.decided.Store(true)
	if cur := s.policy.Load(); cur != pp {
		// A policy update ran between the decision and now, and may
		// have skipped this connection: decide again under it.
		if d2 := p.decide(s.ctx, s.id, *cur, dst.Addr(), ev.Name); !d2.allow || !slices.Equal(cur.CredentialsFor(ev.Name), creds) ||
			!policy.RequestRulesEqual(cur.Requests, pol.Requests) {
			if d2.allow {
				d2.reason = "its credential or request rules changed"
			}
			reset(client)
			p.Stats.Denied.Add(1)
			ev.Verdict, ev.Reason = audit.Denied, d2.reason
			p.cfg.Audit.Write(ev)
			return
		}
	}
	p.Stats.Allowed.Add(1)
	ev.Verdict = audit.Allowed
	switch {
	case hello != nil && terminate:
		ev.Mode = "terminated"
		p.Stats.Terminated.Add(1)
		for _, cr := range creds {
			ev.Injected = append(ev.Injected, cr.Header)
		}
		// The ClientHello, then what br holds past it, then the socket.
		err = p.terminate(s, c, &prefixConn{Conn: cc, r: io.MultiReader(bytes.NewReader(hello), br)}, ev.Name, creds, reqs, strict)
	case hello != nil:
		var up net.Conn
		if up, err = p.dial(s.ctx, c); err == nil {
			if _, err = up.Write(hello); err == nil {
				splice(cc, br, up)
			}
		}
	default:
		// Plain HTTP: every request on the connection must name the
		// host the first one did (a second request for another virtual
		// host of the same address is refused). Credentials are never
		// sent in clear text.
		// Request rules apply as over TLS; the first request is
		// checked before anything is dialled.
		if !policy.RequestAllowed(reqs, req.Method, req.URL) {
			err = refuseRequest(cc, req, ev.Name)
			break
		}
		var up net.Conn
		if up, err = p.dial(s.ctx, c); err == nil {
			err = p.relayHTTP(br, head, cc, up, req, ev.Name, nil, reqs, strict)
		}
	}
	var ref *refusal
	if err == nil && !c.cut.Load() && (hello == nil || terminate) || errors.As(err, &ref) && ref.answered {
		// A finished HTTP exchange ends with a FIN, not the RST of a
		// refusal: the client may not have read the last response yet
		// (a request with "Connection: close" ends the relay as soon as
		// the response is written), and an RST would discard it.
		closeGracefully(client)
	}
	switch {
	case err == nil || c.cut.Load():
	case errors.As(err, &ref):
		// A later request on the connection named another host, or
		// a request the host's request rules refuse.
		ev.Verdict, ev.Reason = audit.Denied, err.Error()
		p.Stats.Denied.Add(1)
	default:
		// Allowed by the policy, but not carried: the upstream refused
		// or failed TLS verification.
		ev.Verdict, ev.Reason = audit.Failed, err.Error()
		p.Stats.Failed.Add(1)
	}
	ev.BytesOut, ev.BytesIn = cc.read.Load(), cc.written.Load()
	ev.DurationMS = ms(time.Since(start))
	p.cfg.Audit.Write(ev)
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// dial opens the upstream connection for c from the agent's namespace.
func (p *Proxy) dial(ctx context.Context, c *conn) (net.Conn, error) {
	d := net.Dialer{Timeout: p.cfg.DialTimeout}
	up, err := d.DialContext(ctx, "tcp4", c.dst.String())
	if err != nil {
		return nil, err
	}
	if !c.setUpstream(up) {
		up.Close()
		return nil, errors.New("cut by a policy update")
	}
	return up, nil
}

// splice copies both ways until both sides end; br holds what was read
// from the client and not yet sent.
func splice(client net.Conn, br *bufio.Reader, up net.Conn) {
	done := make(chan struct{})
	go func() {
		_, _ = io.Copy(up, br)
		if tc, ok := up.(*net.TCPConn); ok {
			_ = tc.CloseWrite()
		}
		close(done)
	}()
	_, _ = io.Copy(client, up)
	if tc, ok := client.(interface{ CloseWrite() error }); ok {
		_ = tc.CloseWrite()
	}
	<-done
	client.Close()
	up.Close()
}

// relayHTTP carries HTTP/1 requests from the client (br, w) to up one at
// a time, first (already read) then the rest, each of which must be for
// host. inject headers are set on every request, replacing the client's.
// A 101 (protocol switch) turns the connection into a plain splice.
// Every request must pass rules (RequestAllowed); the first one refused is
// answered 403 and ends the connection. When strict (under request rules:
// the host's, or bound to a rule host's by the address), a request loses
// the
// headers that make a server read another method or path than the one
// checked (overrideHeaders), and may switch protocols only to websocket
// (checkUpgrade): after a switch the bytes are no longer HTTP/1 requests
// the proxy can check. head bounds each request head read from br.
func (p *Proxy) relayHTTP(br *bufio.Reader, head *headLimit, w net.Conn, up net.Conn, first *http.Request, host string, inject []policy.Credential, rules []policy.RequestRule, strict bool) error {
	ubr := bufio.NewReader(up)
	req := first
	for {
		if req == nil {
			var err error
			if req, err = p.readNext(br, head, w); err != nil {
				if errors.Is(err, io.EOF) {
					return nil
				}
				return err
			}
			if h := hostOnly(req.Host); h != host {
				return &refusal{msg: fmt.Sprintf("request for host %q on a connection for %q refused", h, host)}
			}
		}
		if !policy.RequestAllowed(rules, req.Method, req.URL) {
			return refuseRequest(w, req, host)
		}
		upgrade := false
		if strict {
			for _, h := range overrideHeaders {
				req.Header.Del(h)
			}
			var bad string
			if upgrade, bad = checkUpgrade(req.Header); bad != "" {
				return refuseUpgrade(w, req, host, bad)
			}
		}
		for _, c := range inject {
			req.Header.Set(c.Header, c.Value)
		}
		if err := req.Write(up); err != nil {
			return err
		}
		resp, err := http.ReadResponse(ubr, req)
		// Interim responses (100 Continue, 103 Early Hints) go back as
		// they come, then the final one.
		for err == nil && resp.StatusCode >= 100 && resp.StatusCode < 200 && resp.StatusCode != http.StatusSwitchingProtocols {
			if err = resp.Write(w); err == nil {
				resp, err = http.ReadResponse(ubr, req)
			}
		}
		if err != nil {
			return err
		}
		if resp.StatusCode == http.StatusSwitchingProtocols {
			if strict && (!upgrade || !strings.EqualFold(strings.TrimSpace(resp.Header.Get("Upgrade")), "websocket")) {
				resp.Body.Close()
				return fmt.Errorf("%s switched protocols (to %q) without a websocket upgrade asked for: not relayed under request rules",
					host, resp.Header.Get("Upgrade"))
			}
			if err := resp.Write(w); err != nil {
				return err
			}
			// Whatever the server sent past the response is in ubr.
			go func() { _, _ = io.Copy(w, ubr); w.Close() }()
			_, err := io.Copy(up, br)
			return err
		}
		werr := resp.Write(w)
		resp.Body.Close()
		if werr != nil {
			return werr
		}
		if resp.Close || req.Close {
			return nil
		}
		req = nil
	}
}

// terminate serves a TLS connection for a host with credential or request
// rules: the sandbox gets a certificate for name from the egress CA, the
// upstream gets a TLS connection verified for name, every request must
// pass the request rules and gets the credentials.
func (p *Proxy) terminate(s *sandbox, c *conn, client net.Conn, name string, creds []policy.Credential, rules []policy.RequestRule, strict bool) error {
	leaf, err := p.cfg.CA.Leaf(name)
	if err != nil {
		return err
	}
	ts := tls.Server(client, &tls.Config{Certificates: []tls.Certificate{*leaf}, NextProtos: []string{"http/1.1"},
		MinVersion: tls.VersionTLS12})
	ctx, cancel := context.WithTimeout(s.ctx, p.cfg.PeekTimeout)
	err = ts.HandshakeContext(ctx)
	cancel()
	if err != nil {
		return fmt.Errorf("TLS with the sandbox: %w", err)
	}
	head := &headLimit{r: ts}
	head.limit(MaxRequestHead)
	br := bufio.NewReader(head)
	_ = client.SetReadDeadline(time.Now().Add(p.cfg.PeekTimeout))
	req, err := http.ReadRequest(br)
	if err != nil {
		if head.hit() {
			refuseHead(ts)
			return errHeadTooLarge
		}
		return err
	}
	head.unlimited()
	_ = client.SetReadDeadline(time.Time{})
	if h := hostOnly(req.Host); h != name {
		return &refusal{msg: fmt.Sprintf("request for host %q on a TLS connection for %q refused", h, name)}
	}
	if !policy.RequestAllowed(rules, req.Method, req.URL) {
		// Refused before the upstream is dialled: it never sees it.
		err := refuseRequest(ts, req, name)
		_ = ts.CloseWrite()
		return err
	}
	raw, err := p.dial(s.ctx, c)
	if err != nil {
		return err
	}
	up := tls.Client(raw, &tls.Config{ServerName: name, RootCAs: p.cfg.UpstreamRoots, NextProtos: []string{"http/1.1"},
		MinVersion: tls.VersionTLS12})
	ctx, cancel = context.WithTimeout(s.ctx, p.cfg.DialTimeout)
	err = up.HandshakeContext(ctx)
	cancel()
	if err != nil {
		return fmt.Errorf("TLS with %s: %w", name, err)
	}
	defer up.Close()
	if err := p.relayHTTP(br, head, ts, up, req, name, creds, rules, strict); err != nil {
		var ref *refusal
		if errors.As(err, &ref) && ref.answered {
			_ = ts.CloseWrite()
		}
		return err
	}
	// TLS's own end (close_notify) before the TCP one.
	_ = ts.CloseWrite()
	return nil
}

// refusal is a request the proxy refused by policy (not a failure).
// answered: the client got a 403 for it (a request rule), so the
// connection ends with a FIN rather than a reset that could discard it.
type refusal struct {
	msg      string
	answered bool
}

// refuseRequest answers req with 403 (the connection closes after it) and
// returns the refusal for the audit event.
func refuseRequest(w io.Writer, req *http.Request, host string) error {
	msg := fmt.Sprintf("request %s %s refused by the request rules of %s", req.Method, req.URL.EscapedPath(), host)
	body := "cube egress: " + msg + "\n"
	_, _ = fmt.Fprintf(w, "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s",
		len(body), body)
	return &refusal{msg: msg, answered: true}
}

func (r *refusal) Error() string { return r.msg }

// overrideHeaders make common frameworks (Rails, Spring, IIS, Symfony…)
// serve another method or path than the request line's, which request
// rules check: a request to a host with rules goes without them.
var overrideHeaders = []string{"X-HTTP-Method-Override", "X-HTTP-Method", "X-Method-Override", "X-Original-URL",
	"X-Rewrite-URL", "HTTP2-Settings"}

// checkUpgrade reads a request's protocol switch: upgrade when it asks
// for websocket; bad names any other protocol it asks for (h2c, …),
// which the proxy refuses under request rules (the connection would carry
// requests it cannot check).
func checkUpgrade(h http.Header) (upgrade bool, bad string) {
	for _, v := range h.Values("Upgrade") {
		for tok := range strings.SplitSeq(v, ",") {
			tok = strings.TrimSpace(tok)
			switch {
			case tok == "":
			case strings.EqualFold(tok, "websocket"):
				upgrade = true
			default:
				return false, tok
			}
		}
	}
	return upgrade, ""
}

// refuseUpgrade answers a request that asks to switch to a protocol
// other than websocket with 403.
func refuseUpgrade(w io.Writer, req *http.Request, host, proto string) error {
	msg := fmt.Sprintf("request %s %s: upgrade to %q refused by the request rules of %s (only websocket)", req.Method,
		req.URL.EscapedPath(), proto, host)
	body := "cube egress: " + msg + "\n"
	_, _ = fmt.Fprintf(w, "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s",
		len(body), body)
	return &refusal{msg: msg, answered: true}
}

// MaxRequestHead bounds a request's line and headers (as net/http's
// server does by default: 1 MiB there); maxHello the bytes read for a
// ClientHello.
const (
	MaxRequestHead = 64 << 10
	maxHello       = 80 << 10
)

var errHeadTooLarge = errors.New("request head larger than 64 KiB: answered 431")

// refuseHead answers a request whose head is over MaxRequestHead.
func refuseHead(w io.Writer) {
	const body = "cube egress: request head too large\n"
	_, _ = fmt.Fprintf(w, "HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s",
		len(body), body)
}

// headLimit caps what a bufio.Reader on it reads while a request head is
// read (limit), and lets the body through (unlimited).
type headLimit struct {
	r io.Reader
	n int64 // < 0: unlimited
}

func (h *headLimit) limit(n int64) { h.n = n }
func (h *headLimit) unlimited()    { h.n = -1 }
func (h *headLimit) hit() bool     { return h.n == 0 }

func (h *headLimit) Read(b []byte) (int, error) {
	if h.n == 0 {
		return 0, io.EOF
	}
	if h.n > 0 && int64(len(b)) > h.n {
		b = b[:h.n]
	}
	n, err := h.r.Read(b)
	if h.n > 0 {
		h.n -= int64(n)
	}
	return n, err
}

// readNext reads the next request on a kept-alive connection: the client
// has IdleTimeout to start it and PeekTimeout to finish its head, which
// may hold up to MaxRequestHead bytes (past what br holds already).
func (p *Proxy) readNext(br *bufio.Reader, head *headLimit, c net.Conn) (*http.Request, error) {
	_ = c.SetReadDeadline(time.Now().Add(p.cfg.IdleTimeout))
	if _, err := br.Peek(1); err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return nil, io.EOF
		}
		return nil, err
	}
	_ = c.SetReadDeadline(time.Now().Add(p.cfg.PeekTimeout))
	head.limit(MaxRequestHead)
	req, err := http.ReadRequest(br)
	if err != nil && head.hit() {
		refuseHead(c)
		err = errHeadTooLarge
	}
	head.unlimited()
	_ = c.SetReadDeadline(time.Time{})
	return req, err
}

// hostOnly strips a port and a trailing dot and lowercases.
func hostOnly(h string) string {
	if host, _, err := net.SplitHostPort(h); err == nil {
		h = host
	}
	return strings.TrimSuffix(strings.ToLower(h), ".")
}

// originalDst is where the sandbox sent the connection before the slot's
// redirect.
func originalDst(c *net.TCPConn) (netip.AddrPort, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, err
	}
	var ap netip.AddrPort
	var serr error
	if err := raw.Control(func(fd uintptr) {
		m, err := unix.GetsockoptIPv6Mreq(int(fd), unix.SOL_IP, unix.SO_ORIGINAL_DST)
		if err != nil {
			serr = os.NewSyscallError("getsockopt SO_ORIGINAL_DST", err)
			return
		}
		b := m.Multiaddr
		ap = netip.AddrPortFrom(netip.AddrFrom4([4]byte{b[4], b[5], b[6], b[7]}), uint16(b[2])<<8|uint16(b[3]))
	}); err != nil {
		return ap, err
	}
	return ap, serr
}

// errPeeked stops the TLS handshake once the ClientHello is read.
var errPeeked = errors.New("client hello read")

// peekSNI reads the ClientHello from br and returns its server name and
// the bytes it took (to be replayed).
func peekSNI(br *bufio.Reader) (string, []byte, error) {
	rec := &recordConn{r: br}
	var name string
	err := tls.Server(rec, &tls.Config{GetConfigForClient: func(h *tls.ClientHelloInfo) (*tls.Config, error) {
		name = h.ServerName
		return nil, errPeeked
	}}).Handshake()
	if !errors.Is(err, errPeeked) {
		if err == nil {
			err = errors.New("no ClientHello")
		}
		return "", nil, err
	}
	return hostOnly(name), rec.buf.Bytes(), nil
}

// recordConn is a read-only net.Conn that keeps what was read.
type recordConn struct {
	r   io.Reader
	buf bytes.Buffer
}

func (c *recordConn) Read(b []byte) (int, error) {
	n, err := c.r.Read(b)
	c.buf.Write(b[:n])
	return n, err
}
func (c *recordConn) Write(b []byte) (int, error)      { return 0, io.ErrClosedPipe }
func (c *recordConn) Close() error                     { return nil }
func (c *recordConn) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (c *recordConn) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (c *recordConn) SetDeadline(time.Time) error      { return nil }
func (c *recordConn) SetReadDeadline(time.Time) error  { return nil }
func (c *recordConn) SetWriteDeadline(time.Time) error { return nil }

// prefixConn reads from r (bytes already read, then the connection).
type prefixConn struct {
	net.Conn
	r io.Reader
}

func (c *prefixConn) Read(b []byte) (int, error) { return c.r.Read(b) }

// countConn counts the bytes each way.
type countConn struct {
	net.Conn
	read, written atomic.Int64
}

func (c *countConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.read.Add(int64(n))
	return n, err
}

func (c *countConn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	c.written.Add(int64(n))
	return n, err
}

func (c *countConn) CloseWrite() error {
	if tc, ok := c.Conn.(*net.TCPConn); ok {
		return tc.CloseWrite()
	}
	return nil
}

// CADER returns the egress CA certificate, DER (nil without one).
func (p *Proxy) CADER() []byte {
	if p.cfg.CA == nil {
		return nil
	}
	return p.cfg.CA.Cert.Raw
}

// CA returns the PEM of the egress CA (nil without one).
func (p *Proxy) CA() []byte {
	if p.cfg.CA == nil {
		return nil
	}
	return p.cfg.CA.PEM
}

// Health reports whether every sandbox in ids is served (its listener is
// open): a slot without its listener refuses its redirected connections.
func (p *Proxy) Health(ids []string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	var missing []string
	for _, id := range ids {
		if p.slots[id] == nil {
			missing = append(missing, id)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("egress proxy does not serve %d assigned sandboxes (%s…)", len(missing), missing[0])
	}
	return nil
}
