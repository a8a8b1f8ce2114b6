// Package serve runs a daemon's listeners: gRPC servers and HTTP servers
// on unix sockets and TCP addresses, started together and stopped
// together when the daemon's context ends (gracefully, within a bound),
// with the unix sockets removed on the way out. Unix sockets are always
// mode 0600: only the daemon's account (root) may connect. cubelet,
// network-agent and cubemaster's node API share it, so every listener is
// opened, logged and closed the same way.
package serve

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
)

// Group is a set of servers, each on its listener. Add them, then Run.
// A Group whose Run was never called must be Closed.
type Group struct {
	Log *slog.Logger
	// Grace bounds a graceful gRPC stop (in-flight calls finish) before
	// the servers are stopped hard; 10 s when zero.
	Grace time.Duration

	grpcs   []grpcServe
	https   []httpServe
	sockets []string
}

type grpcServe struct {
	s    *grpc.Server
	l    net.Listener
	name string
}

type httpServe struct {
	s    *http.Server
	l    net.Listener
	name string
}

// Unix listens on the unix socket path with mode 0600 (the daemon's own
// account only), creating its directory and replacing a stale socket a
// killed daemon left. Run removes the socket when it returns.
//
// The mode does not depend on the process's umask and there is no moment
// at which the socket is open to others: it is bound on an OS thread of
// its own whose umask is 0177 (a bind followed by a chmod would leave a
// window in which any account the umask allows could connect, and a
// connection made then stays).
func (g *Group) Unix(path string) (net.Listener, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	_ = os.Remove(path)
	l, err := listenPrivate(path)
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	// The thread's umask made it 0600 already; say so explicitly too.
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	g.sockets = append(g.sockets, path)
	return l, nil
}

// Accepting says whether a server accepts connections on the unix socket
// path. The socket's file exists from the bind, a moment before listen(2)
// makes it connectable, so a client that waits for a daemon must wait for
// this, not for the file: a dial in between is refused.
func Accepting(path string) bool {
	c, err := net.DialTimeout("unix", path, time.Second)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

// listenPrivate binds path with umask 0177 on a locked OS thread that has
// left the process's shared filesystem attributes (unshare CLONE_FS), so
// the umask of no other goroutine changes, not even for an instant. The
// thread is never unlocked: it ends with the goroutine instead of going
// back to the scheduler with its own umask.
func listenPrivate(path string) (net.Listener, error) {
	type result struct {
		l   net.Listener
		err error
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_FS); err != nil {
			done <- result{err: fmt.Errorf("unshare CLONE_FS: %w", err)}
			return
		}
		unix.Umask(0o177)
		l, err := net.Listen("unix", path)
		done <- result{l, err}
	}()
	r := <-done
	return r.l, r.err
}

// TCP listens on addr, the value of setting (ListenTCP), serving TLS with
// tc. Without tc only a loopback address is allowed; the refusal names
// tlsSetting.
func (g *Group) TCP(setting, tlsSetting, addr string, tc *tls.Config) (net.Listener, error) {
	l, err := ListenTCP(setting, tlsSetting, addr, tc != nil)
	if err != nil || tc == nil {
		return l, err
	}
	return tls.NewListener(l, tc), nil
}

// GRPC serves s on l once Run starts; name says what it is in the log.
func (g *Group) GRPC(name string, s *grpc.Server, l net.Listener) {
	g.grpcs = append(g.grpcs, grpcServe{s: s, l: l, name: name})
}

// HTTP serves h on l once Run starts.
func (g *Group) HTTP(name string, h http.Handler, l net.Listener) {
	g.https = append(g.https, httpServe{s: &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}, l: l, name: name})
}

// Close closes every listener added so far and removes the sockets: the
// cleanup of a start-up that failed before Run.
func (g *Group) Close() {
	for _, s := range g.grpcs {
		s.l.Close()
	}
	for _, s := range g.https {
		s.l.Close()
	}
	g.removeSockets()
}

func (g *Group) removeSockets() {
	for _, p := range g.sockets {
		_ = os.Remove(p)
	}
}

// Run serves until ctx ends or a gRPC server fails, then stops everything
// and returns the failure (nil after ctx ended).
func (g *Group) Run(ctx context.Context) error {
	log := g.Log
	if log == nil {
		log = slog.Default()
	}
	grace := g.Grace
	if grace == 0 {
		grace = 10 * time.Second
	}
	errc := make(chan error, len(g.grpcs))
	for _, s := range g.https {
		log.Info(s.name+" listening", "addr", s.l.Addr().String())
		go func() {
			if err := s.s.Serve(s.l); !errors.Is(err, http.ErrServerClosed) {
				log.Error(s.name+" stopped", "err", err)
			}
		}()
	}
	for _, s := range g.grpcs {
		log.Info(s.name+" listening", "addr", s.l.Addr().String())
		go func() { errc <- s.s.Serve(s.l) }()
	}
	var err error
	select {
	case <-ctx.Done():
	case err = <-errc:
		if errors.Is(err, grpc.ErrServerStopped) {
			err = nil
		}
	}
	stoppedServers := map[*grpc.Server]bool{}
	for _, s := range g.grpcs {
		if stoppedServers[s.s] { // one server may serve several listeners
			continue
		}
		stoppedServers[s.s] = true
		stopped := make(chan struct{})
		go func() { s.s.GracefulStop(); close(stopped) }()
		select {
		case <-stopped:
		case <-time.After(grace):
			s.s.Stop()
		}
	}
	for _, s := range g.https {
		_ = s.s.Close()
	}
	g.removeSockets()
	return err
}
