// Package masterlink is cubelet's link to cubemaster: it registers the
// node and then reports its state over gRPC every heartbeat interval.
package masterlink

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/cubelet/config"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/pki"
	"github.com/cubesandbox/cube/internal/serve"
)

// Link registers the node with cubemaster and then reports its state
// every interval. It never blocks the cubelet: an unreachable master is
// retried in the background, and sandboxes do not depend on it.
type Link struct {
	cfg    config.MasterConfig
	report Reporter
	log    *slog.Logger
	conn   *grpc.ClientConn
	client masterpb.NodeServiceClient
	cancel context.CancelFunc
	done   chan struct{}
	kick   chan struct{} // sends the next report now
	ctx    context.Context
	once   sync.Once
	// started is set by Run (under once): Stop waits for run only then.
	started bool
}

// Reporter builds the node's report; it is called once per heartbeat.
type Reporter func(ctx context.Context) *masterpb.NodeReport

// New prepares the link to the master; Run starts registering and
// heartbeating. It returns nil when no master is configured (standalone
// node). tc, when set, is the TLS of a master at host:port (a unix socket
// needs none).
func New(c config.MasterConfig, tc *tls.Config, report Reporter, log *slog.Logger) (*Link, error) {
	if c.Addr == "" {
		return nil, nil
	}
	if c.HeartbeatInterval.Duration <= 0 {
		return nil, fmt.Errorf("master.heartbeat_interval must be positive: %w", errdefs.ErrInvalidArgument)
	}
	// Several replicas (a comma-separated list): the link reports to the
	// first that answers and moves on when it goes away; the replicas
	// share what it reports through their catalog.
	target, replicaOpts := serve.ReplicaTarget(c.Addr)
	creds := insecure.NewCredentials()
	if tc != nil && !strings.HasPrefix(target, "unix:") {
		// The master must present a master certificate: a node's (or a
		// proxy's) of the same CA would otherwise pass for it.
		creds = serve.ClientCredentials(pki.ExpectPeer(tc, "", pki.RoleMaster))
	}
	conn, err := grpc.NewClient(target, append(replicaOpts,
		grpc.WithTransportCredentials(creds),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 50 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 2 * time.Second},
			MinConnectTimeout: 2 * time.Second,
		}))...)
	if err != nil {
		return nil, fmt.Errorf("master.addr %q: %v: %w", c.Addr, err, errdefs.ErrInvalidArgument)
	}
	ctx, cancel := context.WithCancel(context.Background())
	if c.Token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, masterpb.NodeTokenHeader, c.Token)
	}
	h := &Link{
		cfg: c, report: report, log: log.With("master", c.Addr), conn: conn, client: masterpb.NewNodeServiceClient(conn),
		cancel: cancel, done: make(chan struct{}), kick: make(chan struct{}, 1), ctx: ctx,
	}
	return h, nil
}

// Run starts registering and heartbeating in the background, once the
// node's API listens: a master that hears of the node places sandboxes
// there at once. Idempotent; nil-safe.
func (h *Link) Run() {
	if h == nil {
		return
	}
	h.once.Do(func() {
		h.started = true
		go h.run(h.ctx)
	})
}

// Kick sends the next report now instead of at the next interval (a
// sandbox died: the master should know at once); nil-safe.
func (h *Link) Kick() {
	if h == nil {
		return
	}
	select {
	case h.kick <- struct{}{}:
	default:
	}
}

// Stop ends the heartbeat; nil-safe.
func (h *Link) Stop() {
	if h == nil {
		return
	}
	h.cancel()
	h.once.Do(func() {}) // a Run after Stop starts nothing
	if h.started {
		<-h.done
	}
	h.conn.Close()
}

func (h *Link) run(ctx context.Context) {
	defer close(h.done)
	interval := h.cfg.HeartbeatInterval.Duration
	registered := false
	var lastErr string
	for {
		callCtx, cancel := context.WithTimeout(ctx, max(interval, 2*time.Second))
		report := h.report(callCtx)
		var err error
		if !registered {
			var resp *masterpb.RegisterResponse
			resp, err = h.client.Register(callCtx, &masterpb.RegisterRequest{Node: report})
			if err == nil {
				registered = true
				if d := resp.GetHeartbeatInterval().AsDuration(); d > 0 {
					interval = d
				}
				h.log.Info("registered with cubemaster", "heartbeat_interval", interval)
			}
		} else {
			var resp *masterpb.HeartbeatResponse
			resp, err = h.client.Heartbeat(callCtx, &masterpb.HeartbeatRequest{Node: report})
			if err == nil && !resp.Registered {
				// The master lost track of us (a fresh catalog): register
				// again right away.
				registered = false
				cancel()
				continue
			}
			if err == nil {
				if d := resp.GetHeartbeatInterval().AsDuration(); d > 0 {
					interval = d
				}
			}
		}
		cancel()
		switch {
		case err != nil && ctx.Err() == nil && err.Error() != lastErr:
			h.log.Warn("cubemaster unreachable; retrying", "err", err)
			lastErr = err.Error()
		case err == nil && lastErr != "":
			h.log.Info("cubemaster reachable again")
			lastErr = ""
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(interval):
		case <-h.kick:
		}
	}
}

// AdvertiseData is where proxies and masters reach this node's data
// listener, bound at bound ("" when it serves none): master.advertise_data,
// else bound when its host is an address, else the host of
// master.advertise (or api.tcp) with bound's port.
func AdvertiseData(c *config.Config, bound string) string {
	if bound == "" {
		return ""
	}
	if c.Master.AdvertiseData != "" {
		return c.Master.AdvertiseData
	}
	h, port, err := net.SplitHostPort(bound)
	if err != nil {
		return bound
	}
	if ip := net.ParseIP(h); ip != nil && !ip.IsUnspecified() {
		return bound
	}
	for _, a := range []string{c.Master.Advertise, c.API.TCP} {
		if ah, _, err := net.SplitHostPort(a); err == nil && ah != "" {
			if ip := net.ParseIP(ah); ip == nil || !ip.IsUnspecified() {
				return net.JoinHostPort(ah, port)
			}
		}
	}
	return bound
}

// Advertise is the address the master should dial to reach this cubelet.
func Advertise(c *config.Config) string {
	switch {
	case c.Master.Advertise != "":
		return c.Master.Advertise
	case (strings.HasPrefix(c.Master.Addr, "unix://") || strings.HasPrefix(c.Master.Addr, "/")) && c.API.Socket != "":
		return "unix://" + c.API.Socket
	case c.API.TCP != "":
		return c.API.TCP
	}
	return "unix://" + c.API.Socket
}
