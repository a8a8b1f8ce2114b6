// Package serve runs a daemon's listeners: gRPC servers and HTTP servers
// on unix sockets and TCP addresses, started together and stopped
// together when the daemon's context ends (gracefully, within a bound),
// with the unix sockets removed on the way out. cubelet, network-agent and
// cubemaster's node API share it, so every listener is opened, logged and
// closed the same way.
package serve

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"time"

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

// Unix listens on the unix socket path, creating its directory and
// replacing a stale socket a killed daemon left. A non-zero mode is set on
// the socket right after it is created and before anything is served on
// it (a connect in between waits for Run); zero leaves the umask's. Run
// removes the socket when it returns.
func (g *Group) Unix(path string, mode os.FileMode) (net.Listener, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	_ = os.Remove(path)
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	if mode != 0 {
		if err := os.Chmod(path, mode); err != nil {
			l.Close()
			return nil, err
		}
	}
	g.sockets = append(g.sockets, path)
	return l, nil
}

// TCP listens on addr.
func (g *Group) TCP(addr string) (net.Listener, error) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", addr, err)
	}
	return l, nil
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
