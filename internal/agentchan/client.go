package agentchan

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"syscall"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/sys/unix"
)

// BaseURL is the URL prefix to use with the clients below: the host part
// is ignored, every request goes over the channel.
const BaseURL = "http://agent"

// The health check of a connection in use: a ping after readIdleTimeout
// without a frame, the connection dropped when pingTimeout passes without
// an answer. It bounds how long a dead connection (the QEMU socket of a
// VM that was paused or replaced) holds requests. Variables for tests.
var (
	readIdleTimeout = 15 * time.Second
	pingTimeout     = 5 * time.Second
)

// Channel is the host's client of one VM's agent channel. All requests
// share one HTTP/2 connection, dialed by the first request after the last
// one was closed; Spare sets one up ahead of need.
type Channel struct {
	// HTTP sends requests over the channel (BaseURL). Its
	// CloseIdleConnections closes the spare too.
	HTTP *http.Client

	// live carries requests normally; spare holds the connection Spare
	// made, without health pings, and carries every request from Spare
	// until CloseIdleConnections.
	live, spare *http2.Transport
	mu          sync.Mutex
	spared      bool
	spareConn   net.Conn // the spare transport's connection, as dialed
}

var _ http.RoundTripper = (*Channel)(nil)

// NewSerial returns the channel to the agent behind QEMU's virtio-serial
// chardev socket at socketPath. QEMU serves one client at a time, so all
// requests share one HTTP/2 connection; when it breaks (the VM restarted
// or was restored into a new QEMU) the next request dials again.
func NewSerial(socketPath string) *Channel {
	return newChannel(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		c, err := d.DialContext(ctx, "unix", socketPath)
		if err != nil {
			return nil, fmt.Errorf("agentchan: dial %s: %w", socketPath, err)
		}
		sc, err := hostSync(ctx, c)
		if err != nil {
			c.Close()
			return nil, err
		}
		return sc, nil
	})
}

// NewVsock returns the channel to the agent listening on vsock cid:port
// (VsockPort in cube guests).
func NewVsock(cid, port uint32) *Channel {
	return newChannel(func(ctx context.Context) (net.Conn, error) { return dialVsock(ctx, cid, port) })
}

// SerialClient is NewSerial's HTTP client.
func SerialClient(socketPath string) *http.Client { return NewSerial(socketPath).HTTP }

// VsockClient is NewVsock's HTTP client.
func VsockClient(cid, port uint32) *http.Client { return NewVsock(cid, port).HTTP }

func newChannel(dial func(ctx context.Context) (net.Conn, error)) *Channel {
	c := &Channel{}
	c.live = &http2.Transport{
		AllowHTTP: true,
		// http2.Transport pools one connection per host and dials it
		// once for concurrent first requests: what QEMU's one-client
		// socket needs. The spare's connection, if one is still open
		// (a request was on it when the channel went back to live), is
		// closed first: QEMU would not answer this one while it is.
		DialTLSContext: func(ctx context.Context, _, _ string, _ *tls.Config) (net.Conn, error) {
			c.dropSpare()
			return dial(ctx)
		},
		ReadIdleTimeout: readIdleTimeout,
		PingTimeout:     pingTimeout,
	}
	c.spare = &http2.Transport{
		AllowHTTP: true,
		DialTLSContext: func(ctx context.Context, _, _ string, _ *tls.Config) (net.Conn, error) {
			conn, err := dial(ctx)
			if err == nil {
				c.mu.Lock()
				c.spareConn = conn
				c.mu.Unlock()
			}
			return conn, err
		},
	}
	c.HTTP = &http.Client{Transport: c}
	return c
}

// RoundTrip sends req on the spare connection while there is one, else
// on the live one. A spare whose other end hung up (its QEMU exited while
// it was held) is closed first, so that the request dials anew rather
// than fail on it before the transport has read the EOF.
func (c *Channel) RoundTrip(req *http.Request) (*http.Response, error) {
	c.mu.Lock()
	t := c.live
	var check net.Conn
	if c.spared {
		t, check = c.spare, c.spareConn
	}
	c.mu.Unlock()
	if check != nil && hungUp(check) {
		c.spare.CloseIdleConnections()
	}
	return t.RoundTrip(req)
}

// CloseIdleConnections closes the idle connections, the spare included;
// requests go on the live transport again.
func (c *Channel) CloseIdleConnections() {
	c.mu.Lock()
	c.spared = false
	c.mu.Unlock()
	c.live.CloseIdleConnections()
	c.spare.CloseIdleConnections()
}

// Close drops the channel's idle connections and its spare connection,
// busy or not.
func (c *Channel) Close() {
	c.CloseIdleConnections()
	c.dropSpare()
}

// dropSpare closes the spare transport's connection, busy or not.
func (c *Channel) dropSpare() {
	c.mu.Lock()
	conn := c.spareConn
	c.spareConn = nil
	c.mu.Unlock()
	if conn != nil {
		conn.Close()
	}
	c.spare.CloseIdleConnections()
}

// Spare sets up the connection the next request will use now: the dial,
// the session handshake and the HTTP/2 session (one GET /health, whose
// answer is not looked at), so that the request after it is one round
// trip. Over virtio-serial under TCG these are round trips through a
// guest that must first be woken, most of a short call's time. A
// warm-pool entry takes one before it is frozen; the guest's HTTP/2
// server waits on it like on any idle connection. The spare connection
// runs no health pings, which a freeze would leave unanswered and which
// would close it, so a call on it is bounded by its context alone; a VM
// that goes away while it is held (its QEMU exits) closes it, and the
// next request dials anew. Call it when no request is in flight: QEMU
// answers a second connection only after the first is closed. Requests
// use the spare connection until CloseIdleConnections; a Spare that
// fails leaves no connection up.
func (c *Channel) Spare(ctx context.Context) error {
	c.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, BaseURL+"/health", nil)
	if err != nil {
		return err
	}
	resp, err := c.spare.RoundTrip(req)
	if err == nil {
		_, err = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
		resp.Body.Close()
	}
	if err != nil {
		// A connection left up would hold QEMU's one client slot while
		// the next request dials on the live transport.
		c.dropSpare()
		return fmt.Errorf("agentchan: spare session: %w", err)
	}
	c.mu.Lock()
	c.spared = true
	c.mu.Unlock()
	return nil
}

// hungUp reports whether conn's other end has closed (or conn is closed).
func hungUp(conn net.Conn) bool {
	if p, ok := conn.(*prefixConn); ok {
		conn = p.Conn
	}
	sc, ok := conn.(syscall.Conn)
	if !ok {
		return false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return true
	}
	up := false
	err = rc.Control(func(fd uintptr) {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLRDHUP}}
		if _, perr := unix.Poll(fds, 0); perr == nil {
			up = fds[0].Revents&(unix.POLLRDHUP|unix.POLLHUP|unix.POLLERR|unix.POLLNVAL) != 0
		}
	})
	return err != nil || up
}
