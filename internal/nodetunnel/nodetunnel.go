// Package nodetunnel is the node data plane: one listener per node
// through which proxies and masters reach the TCP ports of that node's
// sandboxes, from any host.
//
// A sandbox's address (its slot's host IP) is node-local: every node
// allocates slots from its own plan, and two nodes may hand out the same
// address. So nothing off the node dials it. A caller opens a mutual-TLS
// connection to the node's listener and asks, HTTP/1.1 CONNECT style,
// for one sandbox and port:
//
//	CONNECT <sandboxID>:<port> HTTP/1.1
//
// The node admits only certificates of the cluster CA with the proxy or
// master role, checks that the sandbox is its own and running, dials it
// locally (host IP, or the sandbox's network namespace without one), and
// answers 200; from then on the connection carries the bytes both ways
// unbuffered, half-closes included. Errors answer with a status the
// caller maps back to an errdefs kind: 403 (certificate), 404 (not on
// this node), 409 (not running), 502 (the port refused), 400.
//
// The caller checks that the listener presents the certificate of the
// node it meant (pki.ExpectPeer with the node ID): a connection
// intercepted or misrouted to another node fails the handshake instead
// of reaching a sandbox that happens to share the address.
package nodetunnel

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/nsdial"
	"github.com/cubesandbox/cube/internal/pki"
	"github.com/cubesandbox/cube/internal/sandboxid"
	"github.com/cubesandbox/cube/internal/serve"
)

// Endpoint is where a sandbox's ports are on its node: HostIP (its slot)
// or, without one, NetNS (a path to its network namespace, dialled at
// 127.0.0.1).
type Endpoint struct {
	HostIP string
	NetNS  string
}

// Lookup says where a sandbox of this node is. Errors use errdefs:
// NotFound (not on this node), FailedPrecondition (not running).
type Lookup func(ctx context.Context, sandboxID string) (Endpoint, error)

// Roles may call a node listener: the route (cubeproxy) and the master
// (its agent calls and in-process route). A node's or an operator's
// certificate may not.
var Roles = []pki.Role{pki.RoleProxy, pki.RoleMaster}

// Server is the node listener's handler.
type Server struct {
	lookup  Lookup
	log     *slog.Logger
	timeout time.Duration
}

// NewServer returns the handler for a node listener served over mutual TLS.
func NewServer(lookup Lookup, log *slog.Logger) *Server {
	if log == nil {
		log = slog.Default()
	}
	return &Server{lookup: lookup, log: log, timeout: 10 * time.Second}
}

// ServeHTTP implements http.Handler.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.TLS == nil {
		// The listener is only ever served with TLS; a handler mounted
		// elsewhere must not become an unauthenticated way in.
		http.Error(w, "node data listener: mutual TLS required", http.StatusForbidden)
		return
	}
	var leaf *x509.Certificate
	if len(r.TLS.VerifiedChains) > 0 && len(r.TLS.VerifiedChains[0]) > 0 {
		leaf = r.TLS.VerifiedChains[0][0]
	}
	if err := pki.CheckPeer(leaf, "", Roles...); err != nil {
		s.log.Warn("node data listener: caller refused", "remote", r.RemoteAddr, "err", err)
		http.Error(w, err.Error(), http.StatusForbidden)
		return
	}
	if r.Method != http.MethodConnect {
		http.Error(w, "node data listener: CONNECT <sandboxID>:<port> only", http.StatusMethodNotAllowed)
		return
	}
	id, port, err := parseAuthority(r.Host)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	ep, err := s.lookup(r.Context(), id)
	if err != nil {
		http.Error(w, err.Error(), statusOf(err))
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), s.timeout)
	up, err := dialLocal(ctx, ep, port)
	cancel()
	if err != nil {
		http.Error(w, fmt.Sprintf("sandbox %s port %d: %v", id, port, err), http.StatusBadGateway)
		return
	}
	conn, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		up.Close()
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	// Whatever the caller sent after its request (it may write before
	// reading the answer) is already in brw's reader: it goes first.
	if n := brw.Reader.Buffered(); n > 0 {
		b, _ := brw.Reader.Peek(n)
		if _, err := up.Write(b); err != nil {
			up.Close()
			conn.Close()
			return
		}
	}
	_ = conn.SetDeadline(time.Time{})
	if _, err := io.WriteString(conn, "HTTP/1.1 200 OK\r\n\r\n"); err != nil {
		up.Close()
		conn.Close()
		return
	}
	splice(conn, up)
}

// splice copies both ways until both directions ended, passing each
// half-close on, then closes both.
func splice(a, b net.Conn) {
	var wg sync.WaitGroup
	wg.Add(2)
	one := func(dst, src net.Conn) {
		defer wg.Done()
		_, err := io.Copy(dst, src)
		if cw, ok := dst.(interface{ CloseWrite() error }); ok && err == nil {
			_ = cw.CloseWrite()
		} else {
			// A reset or an error: nothing more will flow either way.
			_ = dst.Close()
			_ = src.Close()
		}
	}
	go one(a, b)
	go one(b, a)
	wg.Wait()
	_ = a.Close()
	_ = b.Close()
}

func dialLocal(ctx context.Context, ep Endpoint, port int) (net.Conn, error) {
	switch {
	case ep.HostIP != "":
		var d net.Dialer
		return d.DialContext(ctx, "tcp", net.JoinHostPort(ep.HostIP, strconv.Itoa(port)))
	case ep.NetNS != "":
		return nsdial.DialContext(ctx, ep.NetNS, "tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	}
	return nil, fmt.Errorf("the sandbox has no address: %w", errdefs.ErrUnavailable)
}

func parseAuthority(a string) (string, int, error) {
	id, ps, err := net.SplitHostPort(a)
	if err != nil {
		return "", 0, fmt.Errorf("CONNECT target %q: want <sandboxID>:<port>: %w", a, errdefs.ErrInvalidArgument)
	}
	port, err := strconv.Atoi(ps)
	if err != nil || port < 1 || port > 65535 {
		return "", 0, fmt.Errorf("CONNECT target %q: bad port: %w", a, errdefs.ErrInvalidArgument)
	}
	if err := sandboxid.Validate("sandbox", id); err != nil {
		return "", 0, err
	}
	return id, port, nil
}

func statusOf(err error) int {
	switch {
	case errdefs.IsNotFound(err):
		return http.StatusNotFound
	case errdefs.IsFailedPrecondition(err):
		return http.StatusConflict
	case errdefs.IsInvalidArgument(err):
		return http.StatusBadRequest
	}
	return http.StatusBadGateway
}

// Serve serves s on ln, which must already speak mutual TLS
// (serve.TLSFiles.MutualServer: the CA's certificates only), until ctx
// ends. Tunnels in progress are cut when it returns.
func Serve(ctx context.Context, s *Server, ln net.Listener) error {
	srv := &http.Server{Handler: s, ReadHeaderTimeout: 30 * time.Second,
		ErrorLog: slog.NewLogLogger(s.log.Handler(), slog.LevelDebug)}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	_ = srv.Close()
	return nil
}

// Listener wraps ln so that it serves TLS with tc, offering HTTP/1.1
// only (CONNECT is HTTP/1.1's).
func Listener(ln net.Listener, tc *tls.Config) net.Listener {
	c := tc.Clone()
	c.NextProtos = []string{"http/1.1"}
	return tls.NewListener(ln, c)
}

// Dialer opens connections to sandbox ports through their nodes'
// listeners.
type Dialer struct {
	// TLS is the caller's client configuration (its proxy or master
	// certificate and the cluster CA).
	TLS     *tls.Config
	Timeout time.Duration // per connection; 10 s when zero
}

// Dial connects to port of sandboxID on node nodeID, whose listener is
// addr. The listener must present nodeID's node certificate.
func (d *Dialer) Dial(ctx context.Context, addr, nodeID, sandboxID string, port int) (net.Conn, error) {
	if d.TLS == nil {
		return nil, fmt.Errorf("node %s data listener %s: this component has no cluster certificate ([tls]): %w", nodeID, addr, errdefs.ErrFailedPrecondition)
	}
	timeout := d.Timeout
	if timeout == 0 {
		timeout = 10 * time.Second
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	// The files may have been reissued or the CA rotated since d.TLS
	// was made: present and trust what they hold now.
	tc := pki.ExpectPeer(serve.Current(d.TLS), nodeID, pki.RoleNode)
	tc.NextProtos = []string{"http/1.1"}
	// No session resumption: each tunnel's handshake checks the peer
	// with full certificate verification against the files of now
	// (Go re-verifies a resumed chain too; a full handshake keeps the
	// check in one place: ExpectPeer's).
	tc.ClientSessionCache = nil
	if tc.ServerName == "" {
		if h, _, err := net.SplitHostPort(addr); err == nil {
			tc.ServerName = h
		}
	}
	td := tls.Dialer{Config: tc}
	c, err := td.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("node %s data listener %s: %v: %w", nodeID, addr, err, errdefs.ErrUnavailable)
	}
	conn := c.(*tls.Conn)
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	}
	target := net.JoinHostPort(sandboxID, strconv.Itoa(port))
	if _, err := fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", target, target); err != nil {
		conn.Close()
		return nil, fmt.Errorf("node %s data listener %s: %v: %w", nodeID, addr, err, errdefs.ErrUnavailable)
	}
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("node %s data listener %s: %v: %w", nodeID, addr, err, errdefs.ErrUnavailable)
	}
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
		resp.Body.Close()
		conn.Close()
		return nil, fmt.Errorf("node %s: sandbox %s port %d: %s: %s: %w", nodeID, sandboxID, port, resp.Status, strings.TrimSpace(string(msg)), kindOf(resp.StatusCode))
	}
	// A 2xx answer to CONNECT has no body (net/http gives NoBody): what
	// follows in br is the sandbox's.
	resp.Body.Close()
	_ = conn.SetDeadline(time.Time{})
	return &tunnelConn{Conn: conn, r: br}, nil
}

func kindOf(code int) error {
	switch code {
	case http.StatusForbidden:
		return errdefs.ErrPermissionDenied
	case http.StatusNotFound:
		return errdefs.ErrNotFound
	case http.StatusConflict:
		return errdefs.ErrFailedPrecondition
	case http.StatusBadRequest:
		return errdefs.ErrInvalidArgument
	}
	return errdefs.ErrUnavailable
}

// tunnelConn reads what the response reader already buffered first.
type tunnelConn struct {
	*tls.Conn
	r *bufio.Reader
}

func (c *tunnelConn) Read(p []byte) (int, error) {
	if c.r != nil {
		if c.r.Buffered() > 0 {
			return c.r.Read(p)
		}
		c.r = nil
	}
	return c.Conn.Read(p)
}

// CloseWrite half-closes the tunnel; the node passes it on to the sandbox.
func (c *tunnelConn) CloseWrite() error { return c.Conn.CloseWrite() }

var _ net.Conn = (*tunnelConn)(nil)
