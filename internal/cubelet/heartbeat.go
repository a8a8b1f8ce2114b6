package cubelet

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sort"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/timestamppb"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
)

// heartbeat registers the node with cubemaster and then reports its state
// every interval. It never blocks the cubelet: an unreachable master is
// retried in the background, and sandboxes do not depend on it.
type heartbeat struct {
	s      *Service
	log    *slog.Logger
	conn   *grpc.ClientConn
	client masterpb.NodeServiceClient
	cancel context.CancelFunc
	done   chan struct{}
}

func (s *Service) startHeartbeat() (*heartbeat, error) {
	c := s.cfg.Master
	if c.Addr == "" {
		return nil, nil
	}
	if c.HeartbeatInterval.Duration <= 0 {
		return nil, fmt.Errorf("master.heartbeat_interval must be positive: %w", errdefs.ErrInvalidArgument)
	}
	target := c.Addr
	if strings.HasPrefix(target, "/") {
		target = "unix://" + target
	}
	conn, err := grpc.NewClient(target,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 50 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 2 * time.Second},
			MinConnectTimeout: 2 * time.Second,
		}))
	if err != nil {
		return nil, fmt.Errorf("master.addr %q: %v: %w", c.Addr, err, errdefs.ErrInvalidArgument)
	}
	ctx, cancel := context.WithCancel(context.Background())
	if c.Token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, masterpb.NodeTokenHeader, c.Token)
	}
	h := &heartbeat{
		s: s, log: s.log.With("master", c.Addr), conn: conn, client: masterpb.NewNodeServiceClient(conn),
		cancel: cancel, done: make(chan struct{}),
	}
	go h.run(ctx)
	return h, nil
}

// stop ends the heartbeat; nil-safe.
func (h *heartbeat) stop() {
	if h == nil {
		return
	}
	h.cancel()
	<-h.done
	h.conn.Close()
}

func (h *heartbeat) run(ctx context.Context) {
	defer close(h.done)
	interval := h.s.cfg.Master.HeartbeatInterval.Duration
	registered := false
	var lastErr string
	for {
		callCtx, cancel := context.WithTimeout(ctx, max(interval, 2*time.Second))
		report := h.s.NodeReport(callCtx)
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
		}
	}
}

// advertise is the address the master should dial to reach this cubelet.
func (s *Service) advertise() string {
	c := s.cfg
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

// NodeReport is what the node tells cubemaster: identity, capacity, usage,
// templates and health.
func (s *Service) NodeReport(ctx context.Context) *masterpb.NodeReport {
	r := &masterpb.NodeReport{
		GeneratedAt: timestamppb.Now(),
		NodeId:      s.cfg.Node.ID, Address: s.advertise(), Version: Version,
		DefaultRuntime: s.cfg.Node.DefaultRuntime,
		MaxMilliCpu:    s.cfg.Sandbox.MaxMilliCPU, MaxMemoryMib: s.cfg.Sandbox.MaxMemoryMiB,
		SandboxesByState: map[string]int32{}, SandboxesByTemplate: map[string]int32{},
	}
	if b, err := os.ReadFile("/proc/sys/kernel/random/boot_id"); err == nil {
		r.BootId = strings.TrimSpace(string(b))
	}
	r.PidNamespace, _ = os.Readlink("/proc/self/ns/pid")
	if info, err := s.Info(ctx); err == nil {
		r.Hostname, r.Cpus, r.MemoryBytes = info.Hostname, int32(info.CPUs), info.MemoryBytes
		r.StorageTotalBytes, r.StorageFreeBytes = info.StorageTotal, info.StorageFree
		for _, rt := range info.Runtimes {
			r.Runtimes = append(r.Runtimes, &cubeletpb.RuntimeInfo{Name: rt.Name, Pause: rt.Pause, Checkpoint: rt.Checkpoint, Restore: rt.Restore})
		}
	}
	recs, _ := s.List(ctx, ListFilter{})
	for _, rec := range recs {
		r.SandboxesByState[string(rec.State)]++
		if rec.State == lifecycle.Destroyed {
			continue
		}
		r.SandboxesByTemplate[rec.TemplateID]++
		r.AllocatedMilliCpu += rec.Resources.MilliCPU
		r.AllocatedMemoryMib += rec.Resources.MemoryMiB
	}
	if tmpls, err := s.store.ListTemplates(); err == nil {
		for _, t := range tmpls {
			r.Templates = append(r.Templates, &masterpb.TemplateRef{
				Id: t.ID, Digest: t.Digest, SizeBytes: t.SizeBytes, CreatedAt: timestamppb.New(t.CreatedAt),
				Runtime: t.Runtime, Warm: t.WarmSnapshotID != "",
			})
		}
		sort.Slice(r.Templates, func(i, j int) bool { return r.Templates[i].Id < r.Templates[j].Id })
	}
	ok, conds := s.Health(ctx)
	r.Ok = ok
	for _, c := range conds {
		r.Conditions = append(r.Conditions, &cubeletpb.Condition{Type: c.Type, Ok: c.OK, Message: c.Message})
	}
	return r
}
