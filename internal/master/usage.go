package master

import (
	"context"
	"net/http"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// Metric is one resource sample of a sandbox, from its node's sampler.
type Metric struct {
	Timestamp time.Time
	// CPUCount is the sandbox's CPU allowance in whole CPUs; CPUUsedPct
	// its use since the previous sample, as a percentage of that.
	CPUCount   int
	CPUUsedPct float64
	CPUTime    time.Duration
	// MemUsed excludes the page cache (MemCache), as E2B's envd reports
	// it; MemTotal is the sandbox's memory limit.
	MemUsed, MemTotal, MemCache, MemRSS int64
	Tasks                               int64
	DiskUsed, DiskTotal                 int64
	NetRx, NetTx                        int64
}

// Metrics returns a sandbox's resource samples in [start, end] (zero
// bounds are open), oldest first, from the history its node keeps
// (cubelet [usage]); a paused sandbox keeps the samples of its running
// time. A node without the history (an older cubelet) answers with the
// agent's sample of the moment, for a running sandbox.
func (s *Service) Metrics(ctx context.Context, id string, start, end time.Time) ([]Metric, error) {
	sb, err := s.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	if sb.NodeID == "" {
		return nil, nil
	}
	c, err := s.client(sb.NodeID)
	if err != nil {
		return nil, err
	}
	req := &cubeletpb.SandboxMetricsRequest{SandboxId: id}
	if !start.IsZero() {
		req.Start = timestamppb.New(start)
	}
	if !end.IsZero() {
		req.End = timestamppb.New(end)
	}
	resp, err := c.SandboxMetrics(ctx, req)
	if err = fromGRPC(sb.NodeID, err); errdefs.IsNotImplemented(err) {
		return s.agentMetric(ctx, sb)
	}
	if err != nil {
		return nil, err
	}
	out := make([]Metric, 0, len(resp.Samples))
	for _, m := range resp.Samples {
		total := m.MemLimitBytes
		if total == 0 {
			total = sb.MemoryMiB << 20
		}
		out = append(out, Metric{
			Timestamp: m.At.AsTime(), CPUCount: int(m.CpuCount), CPUUsedPct: m.CpuUsedPct, CPUTime: m.CpuTime.AsDuration(),
			MemUsed: max(m.MemUsedBytes-m.MemCacheBytes, 0), MemTotal: total, MemCache: m.MemCacheBytes, MemRSS: m.MemRssBytes,
			Tasks: m.Tasks, DiskUsed: m.DiskUsedBytes, DiskTotal: m.DiskTotalBytes, NetRx: m.NetRxBytes, NetTx: m.NetTxBytes,
		})
	}
	return out, nil
}

// envdMetrics is envd's GET /metrics body.
type envdMetrics struct {
	Timestamp  int64   `json:"ts"`
	CPUCount   int     `json:"cpu_count"`
	CPUUsedPct float64 `json:"cpu_used_pct"`
	MemTotal   int64   `json:"mem_total"`
	MemUsed    int64   `json:"mem_used"`
	MemCache   int64   `json:"mem_cache"`
	DiskUsed   int64   `json:"disk_used"`
	DiskTotal  int64   `json:"disk_total"`
}

// agentMetric samples a running sandbox's resource use now from its agent
// (which keeps no history).
func (s *Service) agentMetric(ctx context.Context, sb *catalog.Sandbox) ([]Metric, error) {
	if sb.State != catalog.StateRunning {
		return nil, nil
	}
	t, err := s.Resolve(ctx, sb.ID)
	if err != nil {
		return nil, err
	}
	var m envdMetrics
	code, err := s.agents.do(ctx, t, http.MethodGet, "/metrics", sb.EnvdAccessToken, nil, &m)
	if code == http.StatusNotFound {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	ts := time.Now().UTC()
	if m.Timestamp > 0 {
		ts = time.Unix(m.Timestamp, 0).UTC()
	}
	return []Metric{{Timestamp: ts, CPUCount: m.CPUCount, CPUUsedPct: m.CPUUsedPct, MemUsed: m.MemUsed, MemTotal: m.MemTotal,
		MemCache: m.MemCache, DiskUsed: m.DiskUsed, DiskTotal: m.DiskTotal}}, nil
}
