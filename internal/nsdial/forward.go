package nsdial

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
)

// Forwarder relays TCP connections from a host listener to an address
// inside a network namespace: how tests, the Node suite harness and
// developer tools reach a sandbox's agent before network-agent gives the
// sandbox a routable address. Each accepted connection is dialed anew with
// DialContext and the bytes are copied both ways (splice(2) under the hood
// for TCP to TCP), half-closes included, so HTTP/1.1, h2c and streaming
// all pass through unchanged.
type Forwarder struct {
	ln     net.Listener
	netns  string
	target string
	log    *slog.Logger

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu    sync.Mutex
	conns map[net.Conn]struct{}
}

// Forward listens on listenAddr (use "127.0.0.1:0" for a free port) and
// forwards to target (an IP:port) inside the netns at netnsPath until
// Close.
func Forward(listenAddr, netnsPath, target string, log *slog.Logger) (*Forwarder, error) {
	if _, _, err := net.SplitHostPort(target); err != nil {
		return nil, fmt.Errorf("forward target %q: %w", target, err)
	}
	if log == nil {
		log = slog.Default()
	}
	ln, err := net.Listen("tcp", listenAddr)
	if err != nil {
		return nil, fmt.Errorf("forward: listen %s: %w", listenAddr, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	f := &Forwarder{ln: ln, netns: netnsPath, target: target, log: log, ctx: ctx, cancel: cancel, conns: map[net.Conn]struct{}{}}
	f.wg.Go(f.accept)
	return f, nil
}

// Addr is the host address to connect to.
func (f *Forwarder) Addr() string { return f.ln.Addr().String() }

// Close stops listening, cuts every relayed connection and waits until
// all of the Forwarder's goroutines are gone.
func (f *Forwarder) Close() error {
	f.cancel()
	err := f.ln.Close()
	f.mu.Lock()
	for c := range f.conns {
		c.Close()
	}
	f.mu.Unlock()
	f.wg.Wait()
	return err
}

func (f *Forwarder) track(c net.Conn) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.ctx.Err() != nil {
		return false
	}
	f.conns[c] = struct{}{}
	return true
}

func (f *Forwarder) untrack(c net.Conn) {
	f.mu.Lock()
	delete(f.conns, c)
	f.mu.Unlock()
	c.Close()
}

func (f *Forwarder) accept() {
	for {
		c, err := f.ln.Accept()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				f.log.Warn("forward: accept", "error", err)
			}
			return
		}
		if !f.track(c) {
			c.Close()
			return
		}
		f.wg.Go(func() { f.relay(c) })
	}
}

func (f *Forwarder) relay(client net.Conn) {
	defer f.untrack(client)
	upstream, err := DialContext(f.ctx, f.netns, "tcp", f.target)
	if err != nil {
		f.log.Debug("forward: dial", "target", f.target, "error", err)
		return
	}
	if !f.track(upstream) {
		upstream.Close()
		return
	}
	defer f.untrack(upstream)
	var wg sync.WaitGroup
	pipe := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src)
		// Pass the EOF on, so the other side sees the half-close and the
		// opposite direction can still finish.
		if cw, ok := dst.(interface{ CloseWrite() error }); ok {
			_ = cw.CloseWrite()
		} else {
			dst.Close()
		}
	}
	wg.Go(func() { pipe(upstream, client) })
	wg.Go(func() { pipe(client, upstream) })
	wg.Wait()
}
