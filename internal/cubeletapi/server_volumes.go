package cubeletapi

import (
	"context"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/sandbox"
)

func volumesFromPB(vs []*pb.VolumeMount) []sandbox.Volume {
	var out []sandbox.Volume
	for _, v := range vs {
		out = append(out, sandbox.Volume{ID: v.GetVolumeId(), Path: v.GetPath(), SizeMiB: v.GetSizeMib()})
	}
	return out
}

func (s *Server) DeleteVolume(ctx context.Context, req *pb.DeleteVolumeRequest) (*pb.DeleteVolumeResponse, error) {
	existed, err := s.svc.DeleteVolume(ctx, req.VolumeId)
	if err != nil {
		return nil, ToGRPC(err, "")
	}
	return &pb.DeleteVolumeResponse{Existed: existed}, nil
}
