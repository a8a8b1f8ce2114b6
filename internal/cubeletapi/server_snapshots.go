package cubeletapi

import (
	"context"

	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/sandbox"
)

func (s *Server) SnapshotSandbox(ctx context.Context, req *pb.SnapshotSandboxRequest) (*pb.SnapshotSandboxResponse, error) {
	res, err := s.svc.Snapshot(ctx, cubelet.SnapshotRequest{
		RequestID: req.RequestId, SandboxID: req.SandboxId, SnapshotID: req.SnapshotId,
		Name: req.Name, Labels: req.Labels, Stop: req.Stop,
	})
	if err != nil {
		return nil, ToGRPC(err, req.SandboxId)
	}
	return &pb.SnapshotSandboxResponse{Snapshot: snapshotToPB(res.Snapshot), Timings: timingsToPB(cubelet.FlowSnapshot, res.Timings)}, nil
}

func (s *Server) ListSnapshots(ctx context.Context, req *pb.ListSnapshotsRequest) (*pb.ListSnapshotsResponse, error) {
	sns, err := s.svc.ListSnapshots(ctx, cubelet.SnapshotFilter{SandboxID: req.SandboxId, Labels: req.Labels})
	if err != nil {
		return nil, ToGRPC(err, req.SandboxId)
	}
	out := &pb.ListSnapshotsResponse{Snapshots: make([]*pb.Snapshot, 0, len(sns))}
	for _, sn := range sns {
		out.Snapshots = append(out.Snapshots, snapshotToPB(sn))
	}
	return out, nil
}

func (s *Server) GetSnapshot(ctx context.Context, req *pb.GetSnapshotRequest) (*pb.GetSnapshotResponse, error) {
	sn, err := s.svc.GetSnapshot(ctx, req.SnapshotId)
	if err != nil {
		return nil, ToGRPC(err, "")
	}
	return &pb.GetSnapshotResponse{Snapshot: snapshotToPB(sn)}, nil
}

func (s *Server) DeleteSnapshot(ctx context.Context, req *pb.DeleteSnapshotRequest) (*pb.DeleteSnapshotResponse, error) {
	err := s.svc.DeleteSnapshot(ctx, req.SnapshotId)
	if req.DeleteExported && (err == nil || errdefs.IsNotFound(err)) {
		err = s.svc.DeleteExported(ctx, req.SnapshotId)
	}
	if err != nil {
		return nil, ToGRPC(err, "")
	}
	return &pb.DeleteSnapshotResponse{}, nil
}

func (s *Server) CloneSandbox(ctx context.Context, req *pb.CloneSandboxRequest) (*pb.CloneSandboxResponse, error) {
	netPolicy, err := networkPolicyFromPB("network", req.Network)
	if err != nil {
		return nil, ToGRPC(err, "")
	}
	res, err := s.svc.Clone(ctx, cubelet.CloneRequest{
		RequestID: req.RequestId, SnapshotID: req.SnapshotId, Count: int(req.Count),
		SandboxIDs: req.SandboxIds, Labels: req.Labels, Annotations: req.Annotations, Env: req.Env,
		Network: netPolicy, AccessTokens: req.AccessTokens,
	})
	if err != nil {
		return nil, ToGRPC(err, "")
	}
	out := &pb.CloneSandboxResponse{Timings: timingsToPB(cubelet.FlowClone, res.Timings)}
	for _, r := range res.Sandboxes {
		out.Sandboxes = append(out.Sandboxes, sandboxToPB(r))
	}
	return out, nil
}

func (s *Server) RollbackSandbox(ctx context.Context, req *pb.RollbackSandboxRequest) (*pb.RollbackSandboxResponse, error) {
	res, err := s.svc.Rollback(ctx, cubelet.RollbackRequest{
		RequestID: req.RequestId, SandboxID: req.SandboxId, SnapshotID: req.SnapshotId,
	})
	if err != nil {
		return nil, ToGRPC(err, req.SandboxId)
	}
	return &pb.RollbackSandboxResponse{Sandbox: sandboxToPB(res.Sandbox), Timings: timingsToPB(cubelet.FlowRollback, res.Timings)}, nil
}

func snapshotToPB(sn *sandbox.Snapshot) *pb.Snapshot {
	if sn == nil {
		return nil
	}
	return &pb.Snapshot{
		Id: sn.ID, Name: sn.Name, SandboxId: sn.SandboxID, ParentSnapshotId: sn.ParentSnapshotID,
		TemplateId: sn.TemplateID, Labels: sn.Labels, CreatedAt: timestamppb.New(sn.CreatedAt),
		SizeBytes: sn.SizeBytes, HasMemory: sn.HasMemory, Runtime: sn.Runtime,
	}
}

func hostMountsFromPB(ms []*pb.HostMount) []sandbox.HostMount {
	var out []sandbox.HostMount
	for _, m := range ms {
		out = append(out, sandbox.HostMount{Source: m.GetSource(), Destination: m.GetDestination(), ReadOnly: m.GetReadOnly()})
	}
	return out
}

func hostMountsToPB(ms []sandbox.HostMount) []*pb.HostMount {
	var out []*pb.HostMount
	for _, m := range ms {
		out = append(out, &pb.HostMount{Source: m.Source, Destination: m.Destination, ReadOnly: m.ReadOnly})
	}
	return out
}

func transferToPB(t cubelet.Transfer, moved int64) *pb.Transfer {
	return &pb.Transfer{LogicalBytes: t.LogicalBytes, StoredBytes: t.StoredBytes, MovedBytes: moved, DurationMs: t.Duration.Milliseconds()}
}

func (s *Server) ExportSnapshot(ctx context.Context, req *pb.ExportSnapshotRequest) (*pb.ExportSnapshotResponse, error) {
	sn, tr, err := s.svc.ExportSnapshot(ctx, req.SnapshotId)
	if err != nil {
		return nil, ToGRPC(err, "")
	}
	return &pb.ExportSnapshotResponse{Snapshot: snapshotToPB(sn), Transfer: transferToPB(tr, tr.Sent)}, nil
}

func (s *Server) ImportSnapshot(ctx context.Context, req *pb.ImportSnapshotRequest) (*pb.ImportSnapshotResponse, error) {
	res, err := s.svc.ImportSnapshot(ctx, req.SnapshotId, req.AllowDiskOnly)
	if err != nil {
		return nil, ToGRPC(err, "")
	}
	return &pb.ImportSnapshotResponse{Snapshot: snapshotToPB(res.Snapshot), Transfer: transferToPB(res.Transfer, res.Transfer.Received), MemoryDropped: res.MemoryDropped}, nil
}
