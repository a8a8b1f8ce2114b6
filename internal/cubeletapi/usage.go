package cubeletapi

import (
	"context"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/cubelet/usage"
)

// SandboxMetrics serves the sampler's history of one sandbox.
func (s *Server) SandboxMetrics(ctx context.Context, req *pb.SandboxMetricsRequest) (*pb.SandboxMetricsResponse, error) {
	var start, end time.Time
	if req.Start != nil {
		start = req.Start.AsTime()
	}
	if req.End != nil {
		end = req.End.AsTime()
	}
	samples, err := s.svc.Usage(ctx, req.SandboxId, start, end)
	if err != nil {
		return nil, ToGRPC(err, req.SandboxId)
	}
	out := &pb.SandboxMetricsResponse{Interval: durationpb.New(s.svc.UsageInterval()), Samples: make([]*pb.SandboxSample, 0, len(samples))}
	for _, m := range samples {
		out.Samples = append(out.Samples, sampleToPB(m))
	}
	return out, nil
}

func sampleToPB(m usage.Sample) *pb.SandboxSample {
	return &pb.SandboxSample{
		At: timestamppb.New(m.At), CpuCount: int32(m.CPUCount), CpuUsedPct: m.CPUPct, CpuTime: durationpb.New(m.CPU),
		MemUsedBytes: m.MemUsed, MemRssBytes: m.MemRSS, MemCacheBytes: m.MemCache, MemLimitBytes: m.MemLimit,
		Tasks: m.Pids, DiskUsedBytes: m.DiskUsed, DiskTotalBytes: m.DiskTotal, NetRxBytes: m.NetRx, NetTxBytes: m.NetTx,
	}
}
