// Package nsdial opens TCP connections from inside another network
// namespace, which is how cubelet reaches the agent of a sandbox that has
// no route from the host (a fresh netns, or before networking is wired).
//
// A socket belongs to the network namespace of the thread that created it,
// for its whole life. So DialContext switches one locked OS thread into the
// target namespace just long enough to create and connect the socket, then
// switches it back; the connection is then used from any goroutine.
package nsdial

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"runtime"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// DialContext connects to addr from inside the network namespace at
// netnsPath (/proc/<pid>/ns/net or a bind-mounted netns file).
//
// addr's host must be an IP literal: name resolution would run on other
// threads, in the host's namespace, with the host's resolv.conf.
func DialContext(ctx context.Context, netnsPath, network, addr string) (net.Conn, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("nsdial %s: %w: %w", addr, errdefs.ErrInvalidArgument, err)
	}
	if net.ParseIP(host) == nil {
		return nil, fmt.Errorf("nsdial %s: host must be an IP address: %w", addr, errdefs.ErrInvalidArgument)
	}
	target, err := os.Open(netnsPath)
	if err != nil {
		return nil, fmt.Errorf("nsdial: open netns: %w", err)
	}
	defer target.Close()

	type result struct {
		conn net.Conn
		err  error
	}
	res := make(chan result, 1)
	// A fresh goroutine owns the thread switch, so the caller's goroutine
	// (and whatever thread it runs on) never changes namespace.
	go func() {
		conn, err := dialIn(ctx, int(target.Fd()), network, addr)
		res <- result{conn, err}
	}()
	r := <-res
	if r.err != nil {
		return nil, fmt.Errorf("nsdial %s via %s: %w", addr, netnsPath, r.err)
	}
	return r.conn, nil
}

func dialIn(ctx context.Context, targetFd int, network, addr string) (conn net.Conn, err error) {
	runtime.LockOSThread()
	orig, err := os.Open(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()))
	if err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("open own netns: %w", err)
	}
	defer orig.Close()
	if err := unix.Setns(targetFd, unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("setns: %w", err)
	}
	// With an IP literal and no fallback address, net.Dialer creates the
	// socket on this goroutine, hence on this thread, in the target netns.
	conn, err = (&net.Dialer{}).DialContext(ctx, network, addr)
	if rerr := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); rerr != nil {
		// Leave the thread locked: when this goroutine returns, the Go
		// runtime kills a locked thread instead of reusing it in the
		// wrong namespace.
		if conn != nil {
			conn.Close()
		}
		return nil, fmt.Errorf("restore netns: %w", rerr)
	}
	runtime.UnlockOSThread()
	return conn, err
}

// HTTPClient returns a client whose connections are all dialed inside the
// network namespace at netnsPath. Proxy settings from the environment are
// ignored: a proxy would be dialed in the namespace too, where it is not.
func HTTPClient(netnsPath string) *http.Client {
	return &http.Client{
		Transport: &http.Transport{
			Proxy: nil,
			DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
				return DialContext(ctx, netnsPath, network, addr)
			},
			MaxIdleConns:        4,
			IdleConnTimeout:     30 * time.Second,
			TLSHandshakeTimeout: 10 * time.Second,
		},
	}
}
