package agentchan

import (
	"context"
	"crypto/tls"
	"fmt"
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

// pingTimeout bounds how long a dead connection (the QEMU socket of a VM
// that was paused or replaced) holds requests before it is dropped.
const pingTimeout = 5 * time.Second

// Channel is the host's client of one VM's agent channel. All requests
// share one HTTP/2 connection, dialed by the first request after the last
// one was closed; Spare dials and handshakes one ahead of need.
type Channel struct {
	// HTTP sends requests over the channel (BaseURL).
	HTTP *http.Client
	dial func(ctx context.Context) (net.Conn, error)

	mu    sync.Mutex
	spare net.Conn // handshaken, no HTTP/2 on it yet
}

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
	c := &Channel{dial: dial}
	c.HTTP = &http.Client{Transport: &http2.Transport{
		AllowHTTP: true,
		// http2.Transport pools one connection per host and dials it
		// once for concurrent first requests: what QEMU's one-client
		// socket needs.
		DialTLSContext: func(ctx context.Context, _, _ string, _ *tls.Config) (net.Conn, error) {
			return c.take(ctx)
		},
		ReadIdleTimeout: 15 * time.Second,
		PingTimeout:     pingTimeout,
	}}
	return c
}

// Spare dials the channel and runs the session handshake now, so that
// the next request that needs a connection starts its HTTP/2 session on
// it at once: over virtio-serial under TCG the dial and handshake are
// round trips through a guest that must first be woken, most of a short
// call's time. A warm-pool entry takes one before it is frozen; the
// guest waits in the handshake, holding nothing, until a claim thaws it.
// The spare holds no HTTP/2 connection, so no health ping runs into the
// freeze. Call it when no request is in flight: QEMU answers a second
// connection only after the first is closed. A spare already held and
// still open is kept.
func (c *Channel) Spare(ctx context.Context) error {
	c.mu.Lock()
	old := c.spare
	c.spare = nil
	c.mu.Unlock()
	if old != nil {
		if open(old) {
			c.putSpare(old)
			return nil
		}
		old.Close()
	}
	c.HTTP.CloseIdleConnections()
	conn, err := c.dial(ctx)
	if err != nil {
		return err
	}
	c.putSpare(conn)
	return nil
}

func (c *Channel) putSpare(conn net.Conn) {
	c.mu.Lock()
	old := c.spare
	c.spare = conn
	c.mu.Unlock()
	if old != nil {
		old.Close()
	}
}

// take is the transport's dial: the spare while it is still open, else a
// new connection.
func (c *Channel) take(ctx context.Context) (net.Conn, error) {
	c.mu.Lock()
	s := c.spare
	c.spare = nil
	c.mu.Unlock()
	if s != nil {
		if open(s) {
			return s, nil
		}
		s.Close()
	}
	return c.dial(ctx)
}

// Close drops the channel's connections, the spare included.
func (c *Channel) Close() {
	c.HTTP.CloseIdleConnections()
	c.mu.Lock()
	s := c.spare
	c.spare = nil
	c.mu.Unlock()
	if s != nil {
		s.Close()
	}
}

// open reports whether a spare is still fit for a new session: open at
// both ends with nothing to read (the guest sends nothing after its
// acknowledgement until the HTTP/2 preface has come; anything else, or
// a hang-up when QEMU exits, means the session is not the one the
// handshake set up).
func open(conn net.Conn) bool {
	if p, ok := conn.(*prefixConn); ok {
		if len(p.prefix) > 0 {
			return false
		}
		conn = p.Conn
	}
	sc, ok := conn.(syscall.Conn)
	if !ok {
		return true
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	quiet := false
	err = rc.Control(func(fd uintptr) {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN | unix.POLLRDHUP}}
		n, perr := unix.Poll(fds, 0)
		quiet = perr == nil && n == 0
	})
	return err == nil && quiet
}
