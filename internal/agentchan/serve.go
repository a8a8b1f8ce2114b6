// Package agentchan is the host<->guest agent channel of the VM runtime:
// cube-agent's HTTP API served over virtio-serial (always) and vsock
// (where the guest has a vsock transport), as cleartext HTTP/2 with prior
// knowledge, so one byte stream carries any number of concurrent requests.
//
// The serial port is a single stream with no connection semantics of its
// own: the host end (QEMU's chardev unix socket) comes and goes, and while
// it is away reads return EOF. The guest therefore serves one HTTP/2
// connection per host connection: it opens the port, waits until the host
// end is connected, serves until EOF, closes the port (which drops any
// stale bytes) and starts again. docs/vm-guest.md describes the protocol.
package agentchan

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/cubesandbox/cube/internal/agentproto"
	"golang.org/x/net/http2"
	"golang.org/x/sys/unix"
)

// SerialPort is where udev-less guests find the agent port: the kernel's
// virtio_console names it by its QEMU name under /dev/virtio-ports only
// through udev, so Serve also looks it up in sysfs (see findPort).
const SerialPort = "/dev/virtio-ports/org.cube.agent"

// PortName is the virtserialport name= the host gives the agent port.
const PortName = "org.cube.agent"

// VsockPort is the guest vsock port (envd's TCP port, for symmetry).
const VsockPort = agentproto.Port

// maxWait bounds how long the guest sleeps between checks for a host
// connection when no SIGIO comes (a missed or coalesced signal).
const maxWait = time.Second

// Serve serves handler on the agent port, one host connection at a time,
// and on vsock when the guest has a vsock transport, until ctx is done.
func Serve(ctx context.Context, handler http.Handler, log *slog.Logger) error {
	if log == nil {
		log = slog.Default()
	}
	var wg sync.WaitGroup
	if _, err := os.Stat("/dev/vsock"); err == nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := ServeVsock(ctx, handler, VsockPort); err != nil && ctx.Err() == nil {
				log.Warn("agent channel: vsock", "error", err)
			}
		}()
	}
	err := ServeSerial(ctx, "", handler, log)
	wg.Wait()
	return err
}

// ServeSerial serves handler on the virtio-serial port at path (found by
// name when empty) until ctx is done.
func ServeSerial(ctx context.Context, path string, handler http.Handler, log *slog.Logger) error {
	if log == nil {
		log = slog.Default()
	}
	if path == "" {
		p, err := findPort(ctx, PortName)
		if err != nil {
			return err
		}
		path = p
	}
	// virtio_console raises SIGIO on the port's owner when the host end
	// connects or disconnects (O_ASYNC + F_SETOWN below): the wake-up that
	// lets an idle guest answer a new host within milliseconds without
	// polling a port whose poll() reports HUP the whole time it is idle.
	sigio := make(chan os.Signal, 1)
	signal.Notify(sigio, syscall.SIGIO)
	defer signal.Stop(sigio)

	// The port stays open for good: closing it would drop bytes a new
	// host already sent. Sessions are delimited by the handshake in
	// sync.go instead.
	f, err := openPort(path)
	if err != nil {
		return err
	}
	defer f.Close()
	stop := context.AfterFunc(ctx, func() { f.Close() })
	defer stop()
	h2 := &http2.Server{}
	pc := &portConn{File: f}
	for ctx.Err() == nil {
		if err := waitHost(ctx, f, sigio); err != nil {
			return nil // ctx done: a clean stop
		}
		// EOF here or in ServeConn means the host went away: wait for
		// the next one. Other errors are a broken session: resync.
		if err := f.SetDeadline(time.Time{}); err != nil {
			return fmt.Errorf("agentchan: %s: %w", path, err)
		}
		pc.session = false
		c, err := guestSync(pc)
		if err != nil {
			if ctx.Err() == nil && !errors.Is(err, io.EOF) {
				log.Debug("agent channel: handshake", "error", err)
			}
			continue
		}
		pc.session = true
		log.Debug("agent channel: host connected", "port", path)
		h2.ServeConn(c, &http2.ServeConnOpts{Context: ctx, Handler: handler})
		log.Debug("agent channel: session ended", "port", path)
	}
	return nil
}

func openPort(path string) (*os.File, error) {
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_NONBLOCK|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
	if err != nil {
		return nil, fmt.Errorf("agentchan: open %s: %w", path, err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_SETOWN, unix.Getpid()); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("agentchan: F_SETOWN %s: %w", path, err)
	}
	fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
	if err == nil {
		_, err = unix.FcntlInt(uintptr(fd), unix.F_SETFL, fl|unix.O_ASYNC)
	}
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("agentchan: O_ASYNC %s: %w", path, err)
	}
	// Non-blocking, so the file joins Go's poller and Close interrupts a
	// pending Read.
	return os.NewFile(uintptr(fd), path), nil
}

// hostConnected reports whether the host end is open: virtio_console's
// poll sets POLLHUP while it is not.
func hostConnected(f *os.File) (bool, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return false, err
	}
	var connected bool
	var perr error
	err = rc.Control(func(fd uintptr) {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN | unix.POLLOUT}}
		_, perr = unix.Poll(fds, 0)
		connected = fds[0].Revents&unix.POLLHUP == 0
	})
	if err == nil {
		err = perr
	}
	return connected, err
}

// waitHost blocks until the host end is connected or ctx is done. It
// re-checks on every SIGIO and, in case one is missed, after a backoff
// that doubles from 10 ms to maxWait.
func waitHost(ctx context.Context, f *os.File, sigio <-chan os.Signal) error {
	backoff := 10 * time.Millisecond
	t := time.NewTimer(0)
	defer t.Stop()
	<-t.C
	for {
		ok, err := hostConnected(f)
		if err != nil && !errors.Is(err, unix.EINTR) {
			return err
		}
		if ok {
			return nil
		}
		t.Reset(backoff)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-sigio:
			if !t.Stop() {
				<-t.C
			}
		case <-t.C:
			backoff = min(backoff*2, maxWait)
		}
	}
}

// findPort finds the /dev node of the virtio-serial port named name: the
// udev symlink when there is one, else through sysfs (no udev in the
// guest). The port may appear a little after boot; wait for it.
func findPort(ctx context.Context, name string) (string, error) {
	for delay := 5 * time.Millisecond; ; delay = min(delay*2, 200*time.Millisecond) {
		if _, err := os.Stat("/dev/virtio-ports/" + name); err == nil {
			return "/dev/virtio-ports/" + name, nil
		}
		ents, _ := os.ReadDir("/sys/class/virtio-ports")
		for _, e := range ents {
			b, err := os.ReadFile("/sys/class/virtio-ports/" + e.Name() + "/name")
			if err == nil && string(trimNL(b)) == name {
				return "/dev/" + e.Name(), nil
			}
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("agentchan: virtio-serial port %q: %w", name, ctx.Err())
		case <-time.After(delay):
		}
	}
}

func trimNL(b []byte) []byte {
	for len(b) > 0 && (b[len(b)-1] == '\n' || b[len(b)-1] == 0) {
		b = b[:len(b)-1]
	}
	return b
}

// portConn makes the port a net.Conn for the handshake and one HTTP/2
// session. It reads in chunks and, in a session, ends the session (EOF)
// when a chunk opens with a new host's SYNC, which stays buffered for the
// next handshake: a host that reconnected before the old session saw EOF
// is answered in milliseconds, not after the old session times out.
// Close ends the session, not the port: it only cuts pending reads and
// writes (the next session clears the deadline).
type portConn struct {
	*os.File
	buf     []byte // read but not yet consumed
	chunk   [32 << 10]byte
	session bool
}

func (p *portConn) Read(b []byte) (int, error) {
	if len(p.buf) == 0 {
		n, err := p.File.Read(p.chunk[:])
		if n == 0 {
			return 0, err
		}
		p.buf = p.chunk[:n]
	}
	if p.session && bytes.HasPrefix(p.buf, []byte(syncPrefix)) {
		return 0, io.EOF
	}
	n := copy(b, p.buf)
	p.buf = p.buf[n:]
	return n, nil
}

func (p *portConn) Close() error { return p.File.SetDeadline(time.Now()) }

func (*portConn) LocalAddr() net.Addr  { return portAddr{} }
func (*portConn) RemoteAddr() net.Addr { return portAddr{} }

type portAddr struct{}

func (portAddr) Network() string { return "virtio-serial" }
func (portAddr) String() string  { return PortName }
