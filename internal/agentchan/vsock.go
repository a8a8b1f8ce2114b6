package agentchan

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// ServeVsock serves handler on AF_VSOCK port until ctx is done. Go's net
// package knows no AF_VSOCK, so the listener is a raw socket in Go's
// poller; connections are served by net/http (HTTP/1.1 and h2c).
func ServeVsock(ctx context.Context, handler http.Handler, port uint32) error {
	ln, err := listenVsock(port)
	if err != nil {
		return err
	}
	protocols := new(http.Protocols)
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true)
	srv := &http.Server{Handler: handler, Protocols: protocols, ReadHeaderTimeout: 10 * time.Second}
	stop := context.AfterFunc(ctx, func() { srv.Close() })
	defer stop()
	err = srv.Serve(ln)
	if ctx.Err() != nil {
		return nil
	}
	return err
}

type vsockListener struct {
	f    *os.File
	port uint32
}

func listenVsock(port uint32) (*vsockListener, error) {
	fd, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("agentchan: vsock socket: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrVM{CID: unix.VMADDR_CID_ANY, Port: port}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("agentchan: vsock bind port %d: %w", port, err)
	}
	if err := unix.Listen(fd, 128); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("agentchan: vsock listen: %w", err)
	}
	return &vsockListener{f: os.NewFile(uintptr(fd), "vsock:"+strconv.Itoa(int(port))), port: port}, nil
}

func (l *vsockListener) Accept() (net.Conn, error) {
	rc, err := l.f.SyscallConn()
	if err != nil {
		return nil, err
	}
	var nfd int
	var sa unix.Sockaddr
	var aerr error
	err = rc.Read(func(fd uintptr) bool {
		nfd, sa, aerr = unix.Accept4(int(fd), unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC)
		return aerr != unix.EAGAIN
	})
	if err != nil {
		return nil, err
	}
	if aerr != nil {
		return nil, aerr
	}
	remote := vsockAddr{}
	if vm, ok := sa.(*unix.SockaddrVM); ok {
		remote = vsockAddr{cid: vm.CID, port: vm.Port}
	}
	return &vsockConn{File: os.NewFile(uintptr(nfd), "vsock"), local: vsockAddr{port: l.port}, remote: remote}, nil
}

func (l *vsockListener) Close() error   { return l.f.Close() }
func (l *vsockListener) Addr() net.Addr { return vsockAddr{port: l.port} }

type vsockConn struct {
	*os.File
	local, remote vsockAddr
}

func (c *vsockConn) LocalAddr() net.Addr  { return c.local }
func (c *vsockConn) RemoteAddr() net.Addr { return c.remote }

type vsockAddr struct{ cid, port uint32 }

func (vsockAddr) Network() string  { return "vsock" }
func (a vsockAddr) String() string { return fmt.Sprintf("%d:%d", a.cid, a.port) }

// dialVsock connects to cid:port from the host.
func dialVsock(ctx context.Context, cid, port uint32) (net.Conn, error) {
	fd, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("agentchan: vsock socket: %w", err)
	}
	f := os.NewFile(uintptr(fd), "vsock")
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, err
	}
	var cerr error
	started := false
	stop := context.AfterFunc(ctx, func() { _ = f.SetDeadline(time.Now()) }) // best effort: unblocks the connect
	defer stop()
	// A non-blocking connect returns EINPROGRESS; the poller reports the
	// socket writable once it completes, and SO_ERROR says how.
	err = rc.Write(func(fd uintptr) bool {
		if !started {
			started = true
			cerr = unix.Connect(int(fd), &unix.SockaddrVM{CID: cid, Port: port})
			return cerr != unix.EINPROGRESS
		}
		v, gerr := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ERROR)
		if gerr != nil {
			cerr = gerr
		} else if v != 0 {
			cerr = unix.Errno(v)
		} else {
			cerr = nil
		}
		return true
	})
	if err == nil {
		err = cerr
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("agentchan: vsock connect %d:%d: %w", cid, port, err)
	}
	if err := f.SetDeadline(time.Time{}); err != nil {
		f.Close()
		return nil, fmt.Errorf("agentchan: vsock connect %d:%d: %w", cid, port, err)
	}
	return &vsockConn{File: f, remote: vsockAddr{cid: cid, port: port}}, nil
}
