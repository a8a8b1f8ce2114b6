package agentchan

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/sys/unix"
)

// The harness stands in for the VM: a socketpair is the virtio-serial
// port (its guest end an *os.File in Go's poller, like openPort's), and a
// unix listener forwarding to the other end is QEMU's chardev socket,
// serving one host connection at a time and dropping guest output while
// no host is connected. The guest never sees EOF when a host leaves: the
// "quick reconnect" case the handshake exists for.

// connPair returns the two ends of a stream socketpair as net.Conns.
func connPair(t *testing.T) (net.Conn, net.Conn) {
	t.Helper()
	a, b := filePair(t)
	bc, err := net.FileConn(b)
	b.Close()
	if err != nil {
		a.Close()
		t.Fatal(err)
	}
	ac, err := net.FileConn(a)
	a.Close()
	if err != nil {
		bc.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() { ac.Close(); bc.Close() })
	return ac, bc
}

// filePair returns a non-blocking socketpair as files; the caller closes.
func filePair(t *testing.T) (*os.File, *os.File) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	return os.NewFile(uintptr(fds[0]), "port-guest"), os.NewFile(uintptr(fds[1]), "port-host")
}

type sessionKey struct{}

// sessionOf is the number of the guest session serving r (1-based).
func sessionOf(r *http.Request) int32 {
	n, _ := r.Context().Value(sessionKey{}).(int32)
	return n
}

type vm struct {
	sock     string // the chardev socket hosts dial
	started  atomic.Int32
	ended    atomic.Int32
	accepted atomic.Int32
	// hangUp closes the chardev's end of the current host connection,
	// as QEMU does when it exits.
	hangUp func()
	// gate, write-locked, freezes the VM: bytes in either direction wait
	// (QMP stop; the host's connection stays open).
	gate sync.RWMutex
}

// gated passes a read on only while the VM is not frozen.
type gated struct {
	r    io.Reader
	gate *sync.RWMutex
}

func (g gated) Read(b []byte) (int, error) {
	n, err := g.r.Read(b)
	g.gate.RLock()
	g.gate.RUnlock() //nolint:staticcheck,gocritic // waiting out a freeze is the point
	return n, err
}

// startVM runs ServeSerial's session loop (without its virtio-only wait
// for a host) on a socketpair port, behind a chardev socket.
func startVM(t *testing.T, h http.Handler) *vm {
	t.Helper()
	v := &vm{sock: filepath.Join(t.TempDir(), "agent.sock")}
	guestF, hostF := filePair(t)
	port, err := net.FileConn(hostF)
	hostF.Close()
	if err != nil {
		guestF.Close()
		t.Fatal(err)
	}
	ln, err := net.Listen("unix", v.sock)
	if err != nil {
		guestF.Close()
		port.Close()
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var mu sync.Mutex
	var cur net.Conn
	v.hangUp = func() {
		mu.Lock()
		defer mu.Unlock()
		if cur != nil {
			cur.Close()
		}
	}

	wg.Add(3)
	go func() { // guest
		defer wg.Done()
		pc := &portConn{File: guestF}
		h2 := &http2.Server{}
		for ctx.Err() == nil {
			if err := guestF.SetDeadline(time.Time{}); err != nil {
				return
			}
			pc.session = false
			c, err := guestSync(pc)
			if err != nil {
				if errors.Is(err, io.EOF) || errors.Is(err, os.ErrClosed) {
					return
				}
				continue
			}
			pc.session = true
			n := v.started.Add(1)
			h2.ServeConn(c, &http2.ServeConnOpts{Context: context.WithValue(ctx, sessionKey{}, n), Handler: h})
			v.ended.Add(1)
		}
	}()
	go func() { // chardev: guest -> current host, dropped when none
		defer wg.Done()
		b := make([]byte, 32<<10)
		for {
			n, err := gated{port, &v.gate}.Read(b)
			mu.Lock()
			c := cur
			mu.Unlock()
			if c != nil && n > 0 {
				_, _ = c.Write(b[:n]) // a host gone mid-write: the next Accept takes over
			}
			if err != nil {
				return
			}
		}
	}()
	go func() { // chardev: one host at a time -> guest
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			v.accepted.Add(1)
			mu.Lock()
			cur = c
			mu.Unlock()
			_, _ = io.Copy(port, gated{c, &v.gate}) // ends when the host hangs up
			mu.Lock()
			cur = nil
			mu.Unlock()
			c.Close()
		}
	}()
	t.Cleanup(func() {
		cancel()
		ln.Close()
		mu.Lock()
		if cur != nil {
			cur.Close()
		}
		mu.Unlock()
		guestF.Close()
		port.Close()
		wg.Wait()
	})
	return v
}

// recordingClient is SerialClient with the dialed conns exposed, so a
// test can cut the host's connection like a dying host process would.
func recordingClient(t *testing.T, sock string) (*http.Client, func() []net.Conn) {
	var mu sync.Mutex
	var conns []net.Conn
	c := newChannel(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		raw, err := d.DialContext(ctx, "unix", sock)
		if err != nil {
			return nil, err
		}
		sc, err := hostSync(ctx, raw)
		if err != nil {
			raw.Close()
			return nil, err
		}
		mu.Lock()
		conns = append(conns, raw)
		mu.Unlock()
		return sc, nil
	}).HTTP
	t.Cleanup(func() {
		c.CloseIdleConnections()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	return c, func() []net.Conn {
		mu.Lock()
		defer mu.Unlock()
		return append([]net.Conn(nil), conns...)
	}
}

func waitFor(t *testing.T, what string, d time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
