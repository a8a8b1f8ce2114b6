package agent

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/cubesandbox/cube/internal/agent/rpcerr"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/errdefs"
)

// Quiesce: before a runtime saves the sandbox's memory, the agent holds no
// TCP socket. gVisor's runsc (20221219) cannot save a listener that a
// goroutine waits on through epoll ("endpoint still has waiters upon
// save") and kills the sandbox trying; it cannot save a connection over
// the slot's veth either. So POST /_cube/quiesce:
//
//  1. refuses (409, FailedPrecondition) when a TCP socket that is not the
//     agent's is open in the sandbox, naming it: the save would fail on it
//     and runsc would take the sandbox down; nothing changes then;
//  2. answers, then waits (up to quiesceCloseWait) for the caller to close
//     its connection first: a passive close leaves nothing behind, whereas
//     the side that closes first keeps the endpoint in TIME_WAIT;
//  3. closes the listener and resets (SO_LINGER 0, no TIME_WAIT) every
//     other connection: cubelet's idle health checks, proxied clients;
//  4. waits for the wake-up (Server.Wake: SIGUSR2 from the runtime to PID
//     1 after the restore, or after a checkpoint that did not happen), or
//     for its own deadline, then listens again.
//
// The processes, filesystem watchers and /init state live on; only the
// sockets go.

// quiesceCloseWait bounds how long the agent waits for the caller to close
// the quiesce request's connection before resetting it.
const quiesceCloseWait = time.Second

// defaultQuiesceTimeout is when a quiesced agent listens again by itself
// if nobody wakes it: a cubelet that died mid-snapshot must not leave the
// sandbox unreachable for good.
const defaultQuiesceTimeout = 5 * time.Minute

// lifecycle is the listener's state across quiesces: the connections the
// http.Server has open (to reset them), the pending quiesce and the wake.
type lifecycle struct {
	mu    sync.Mutex
	conns map[net.Conn]struct{}
	// quiesce carries the quiesce request's connection and deadline from
	// the handler to Serve, which tears the listener down.
	quiesce chan quiesceOrder
	wake    chan struct{}
}

type quiesceOrder struct {
	conn    net.Conn
	timeout time.Duration
}

func newLifecycle() *lifecycle {
	return &lifecycle{conns: map[net.Conn]struct{}{}, quiesce: make(chan quiesceOrder, 1), wake: make(chan struct{}, 1)}
}

func (l *lifecycle) track(c net.Conn, st http.ConnState) {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch st {
	case http.StateNew:
		l.conns[c] = struct{}{}
	case http.StateClosed, http.StateHijacked:
		delete(l.conns, c)
	}
}

func (l *lifecycle) open(c net.Conn) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, ok := l.conns[c]
	return ok
}

// reset aborts every tracked connection: RST instead of FIN, so the
// sandbox keeps no endpoint in TIME_WAIT.
func (l *lifecycle) reset() {
	l.mu.Lock()
	defer l.mu.Unlock()
	for c := range l.conns {
		if tc, ok := c.(*net.TCPConn); ok {
			_ = tc.SetLinger(0)
		}
		_ = c.Close()
		delete(l.conns, c)
	}
}

type connKey struct{}

// maxQuiesceTimeout caps agentproto.QuiesceRequest.TimeoutMs.
const maxQuiesceTimeout = 10 * time.Minute

// Wake makes a quiesced agent listen again; a no-op otherwise.
func (a *Server) Wake() {
	select {
	case a.life.wake <- struct{}{}:
	default:
	}
}

func (a *Server) handleQuiesce(w http.ResponseWriter, r *http.Request) {
	var req agentproto.QuiesceRequest
	if err := decodeOptional(r, &req); err != nil {
		rpcerr.WriteHTTP(w, err)
		return
	}
	timeout := defaultQuiesceTimeout
	if req.TimeoutMs > 0 {
		// Bounded: any process in the sandbox can reach this endpoint on
		// localhost and must not keep the agent deaf for long.
		timeout = time.Duration(min(req.TimeoutMs, maxQuiesceTimeout.Milliseconds())) * time.Millisecond
	}
	conn, _ := r.Context().Value(connKey{}).(net.Conn)
	port := 0
	if conn != nil {
		if ta, ok := conn.LocalAddr().(*net.TCPAddr); ok {
			port = ta.Port
		}
	}
	if port == 0 {
		rpcerr.WriteHTTP(w, fmt.Errorf("quiesce: only over the agent's TCP listener: %w", errdefs.ErrFailedPrecondition))
		return
	}
	foreign, err := ForeignSockets(a.cfg.ProcNet, port)
	if err != nil {
		rpcerr.WriteHTTP(w, fmt.Errorf("quiesce: %w", err))
		return
	}
	if len(foreign) > 0 {
		writeJSON(w, http.StatusConflict, agentproto.QuiesceResponse{Sockets: foreign,
			Error: "TCP sockets other than the agent's are open: " + describe(foreign)})
		return
	}
	// A wake-up left over from an earlier restore (cubelet re-sends them
	// until the agent answers) must not end this quiesce at once.
	select {
	case <-a.life.wake:
	default:
	}
	select {
	case a.life.quiesce <- quiesceOrder{conn: conn, timeout: timeout}:
	default:
		rpcerr.WriteHTTP(w, fmt.Errorf("quiesce: already in progress: %w", errdefs.ErrFailedPrecondition))
		return
	}
	writeJSON(w, http.StatusOK, agentproto.QuiesceResponse{Quiesced: true})
	if f, ok := w.(http.Flusher); ok {
		f.Flush()
	}
}

// quiesced tears down srv, serving ln, after a quiesce order: wait for
// the caller to close its connection, stop accepting, then reset every
// connection. served is srv.Serve's result, which it consumes.
//
// The listener closes first, and Serve must have returned before the
// reset: every connection Serve accepted is then tracked (the StateNew
// hook runs in Serve's loop), so the reset reaches all of them. srv.Close
// alone would close a connection accepted after a reset with a FIN, and
// that endpoint would sit in TIME_WAIT, which runsc cannot save: a failed
// save takes the sandbox down (the caller dials the port until it is
// refused, so connections do arrive during the teardown).
func (a *Server) quiesced(srv *http.Server, ln net.Listener, served <-chan error, o quiesceOrder) error {
	deadline := time.Now().Add(quiesceCloseWait)
	for o.conn != nil && a.life.open(o.conn) && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	_ = ln.Close()
	err := <-served
	a.life.reset()
	_ = srv.Close()
	a.life.reset()
	if errors.Is(err, net.ErrClosed) || errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

// waitWake blocks a quiesced agent until Wake, its deadline or ctx.
func (a *Server) waitWake(ctx context.Context, timeout time.Duration) {
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-a.life.wake:
		a.log.Info("agent woken")
	case <-t.C:
		a.log.Warn("quiesce deadline passed without a wake-up; listening again", "timeout", timeout)
	case <-ctx.Done():
	}
}

// ForeignSockets lists the TCP sockets in procNet's tcp and tcp6 tables
// ("/proc/net" when empty) whose local port is not agentPort. A missing
// table (no IPv6) counts as empty.
func ForeignSockets(procNet string, agentPort int) ([]agentproto.Socket, error) {
	if procNet == "" {
		procNet = "/proc/net"
	}
	var out []agentproto.Socket
	for _, name := range []string{"tcp", "tcp6"} {
		socks, err := readTCPTable(procNet + "/" + name)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		for _, s := range socks {
			if _, p, _ := net.SplitHostPort(s.Local); p != strconv.Itoa(agentPort) {
				out = append(out, s)
			}
		}
	}
	return out, nil
}

// tcpStates names /proc/net/tcp's state codes (include/net/tcp_states.h).
var tcpStates = map[string]string{
	"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1",
	"05": "FIN_WAIT2", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT",
	"09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING",
}

func readTCPTable(path string) ([]agentproto.Socket, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []agentproto.Socket
	sc := bufio.NewScanner(f)
	for first := true; sc.Scan(); first = false {
		fields := strings.Fields(sc.Text())
		if first || len(fields) < 4 {
			continue
		}
		local, err1 := hexAddr(fields[1])
		remote, err2 := hexAddr(fields[2])
		if err := errors.Join(err1, err2); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		st := tcpStates[strings.ToUpper(fields[3])]
		if st == "" {
			st = fields[3]
		}
		out = append(out, agentproto.Socket{Local: local, Remote: remote, State: st})
	}
	return out, sc.Err()
}

// hexAddr decodes "0100007F:C3CF" (an address in host byte order, per
// 32-bit word, and a port) into "127.0.0.1:50127".
func hexAddr(s string) (string, error) {
	h, p, ok := strings.Cut(s, ":")
	port, err := strconv.ParseUint(p, 16, 16)
	if !ok || err != nil || (len(h) != 8 && len(h) != 32) {
		return "", fmt.Errorf("bad socket address %q", s)
	}
	ip := make(net.IP, len(h)/2)
	for w := 0; w < len(h)/8; w++ {
		v, err := strconv.ParseUint(h[w*8:w*8+8], 16, 32)
		if err != nil {
			return "", fmt.Errorf("bad socket address %q", s)
		}
		// Each word is little-endian on the machines we run on.
		ip[w*4], ip[w*4+1], ip[w*4+2], ip[w*4+3] = byte(v), byte(v>>8), byte(v>>16), byte(v>>24)
	}
	return net.JoinHostPort(ip.String(), strconv.Itoa(int(port))), nil
}

func describe(socks []agentproto.Socket) string {
	parts := make([]string, 0, len(socks))
	for _, s := range socks {
		if s.State == "LISTEN" {
			parts = append(parts, "listening on "+s.Local)
		} else {
			parts = append(parts, fmt.Sprintf("%s %s->%s", s.State, s.Local, s.Remote))
		}
	}
	return strings.Join(parts, ", ")
}
