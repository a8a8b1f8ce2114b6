// Package cubeletapi is the gRPC edge of cubelet: a thin adapter from the
// generated service to cubelet.Service; errors become status codes in
// ToGRPC (errors.go), through package errdefs/grpcerr. Clients use package
// cubeletclient, which does not link the daemon.
package cubeletapi

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/template"
)

// Server implements pb.CubeletServiceServer over a cubelet.Service.
type Server struct {
	pb.UnimplementedCubeletServiceServer
	svc *cubelet.Service
}

var _ pb.CubeletServiceServer = (*Server)(nil)

// New returns the gRPC adapter for svc.
func New(svc *cubelet.Service) *Server { return &Server{svc: svc} }

func resourcesFromPB(r *pb.Resources) sandbox.Resources {
	if r == nil {
		return sandbox.Resources{}
	}
	return sandbox.Resources{MilliCPU: r.MilliCpu, MemoryMiB: r.MemoryMib, Pids: r.Pids, DiskMiB: r.DiskMib}
}

func (s *Server) CreateSandbox(ctx context.Context, req *pb.CreateSandboxRequest) (*pb.CreateSandboxResponse, error) {
	netPolicy, err := networkPolicyFromPB("network", req.Network)
	if err != nil {
		return nil, ToGRPC(err, req.SandboxId)
	}
	res, err := s.svc.Create(ctx, cubelet.CreateRequest{
		RequestID: req.RequestId, SandboxID: req.SandboxId, TemplateID: req.TemplateId,
		Runtime: req.Runtime, Labels: req.Labels, Annotations: req.Annotations, Env: req.Env,
		Resources:   resourcesFromPB(req.Resources),
		HostMounts:  hostMountsFromPB(req.HostMounts),
		Volumes:     volumesFromPB(req.Volumes),
		Network:     netPolicy,
		AccessToken: req.AccessToken,
	})
	if err != nil {
		return nil, ToGRPC(err, req.SandboxId)
	}
	flow := cubelet.FlowCreate
	if res.Warm && !res.Pooled { // a claim's steps are its own, not a clone's
		flow = cubelet.FlowClone
	}
	return &pb.CreateSandboxResponse{Sandbox: sandboxToPB(res.Sandbox), Timings: timingsToPB(flow, res.Timings),
		Warm: res.Warm, Warnings: res.Warnings, Pooled: res.Pooled}, nil
}

func (s *Server) GetSandbox(ctx context.Context, req *pb.GetSandboxRequest) (*pb.GetSandboxResponse, error) {
	r, err := s.svc.Get(ctx, req.SandboxId)
	if err != nil {
		return nil, ToGRPC(err, req.SandboxId)
	}
	return &pb.GetSandboxResponse{Sandbox: sandboxToPB(r)}, nil
}

func (s *Server) ListSandboxes(ctx context.Context, req *pb.ListSandboxesRequest) (*pb.ListSandboxesResponse, error) {
	f := cubelet.ListFilter{Labels: req.Labels}
	for _, st := range req.States {
		ls := StateFromPB(st)
		if ls == "" {
			return nil, ToGRPC(&errdefs.FieldError{Field: "states", Msg: "unknown state " + st.String()}, "")
		}
		f.States = append(f.States, ls)
	}
	recs, err := s.svc.List(ctx, f)
	if err != nil {
		return nil, ToGRPC(err, "")
	}
	out := &pb.ListSandboxesResponse{Sandboxes: make([]*pb.Sandbox, 0, len(recs))}
	for _, r := range recs {
		out.Sandboxes = append(out.Sandboxes, sandboxToPB(r))
	}
	return out, nil
}

func (s *Server) DeleteSandbox(ctx context.Context, req *pb.DeleteSandboxRequest) (*pb.DeleteSandboxResponse, error) {
	res, err := s.svc.Delete(ctx, req.SandboxId)
	if err != nil {
		return nil, ToGRPC(err, req.SandboxId)
	}
	return &pb.DeleteSandboxResponse{Timings: timingsToPB(cubelet.FlowDestroy, res.Timings)}, nil
}

func (s *Server) PauseSandbox(ctx context.Context, req *pb.PauseSandboxRequest) (*pb.PauseSandboxResponse, error) {
	mode, err := pauseModeFromPB(req.Mode)
	if err != nil {
		return nil, ToGRPC(err, req.SandboxId)
	}
	res, err := s.svc.PauseTo(ctx, req.SandboxId, mode)
	if err != nil {
		return nil, ToGRPC(err, req.SandboxId)
	}
	return &pb.PauseSandboxResponse{Sandbox: sandboxToPB(res.Sandbox), Timings: timingsToPB(res.Flow, res.Timings)}, nil
}

func (s *Server) ResumeSandbox(ctx context.Context, req *pb.ResumeSandboxRequest) (*pb.ResumeSandboxResponse, error) {
	res, err := s.svc.Resume(ctx, req.SandboxId)
	if err != nil {
		return nil, ToGRPC(err, req.SandboxId)
	}
	return &pb.ResumeSandboxResponse{Sandbox: sandboxToPB(res.Sandbox), Timings: timingsToPB(res.Flow, res.Timings)}, nil
}

func (s *Server) ImportTemplate(req *pb.ImportTemplateRequest, stream pb.CubeletService_ImportTemplateServer) error {
	progress := func(p template.Progress) {
		_ = stream.Send(&pb.ImportTemplateResponse{Event: &pb.ImportTemplateResponse_Progress{Progress: &pb.ImportProgress{
			Phase: p.Phase, Layer: int32(p.Layer), Layers: int32(p.Layers), Bytes: p.Bytes, Total: p.Total,
		}}})
	}
	in := cubelet.TemplateImport{TemplateID: req.TemplateId, Source: req.Source, ImageRef: req.ImageRef, Insecure: req.Insecure, Runtime: req.Runtime,
		Artifact: req.Artifact}
	if a := req.Auth; a != nil {
		in.Username, in.Password, in.Token = a.Username, a.Password, a.Token
	}
	t, err := s.svc.ImportTemplateFrom(stream.Context(), in, progress)
	if err != nil {
		return ToGRPC(err, "")
	}
	if req.Warm {
		progress(template.Progress{Phase: "warm"})
		w, err := s.svc.WarmTemplate(stream.Context(), t.ID, req.Runtime)
		if err != nil {
			return ToGRPC(fmt.Errorf("template %s imported, but warming it failed: %w", t.ID, err), "")
		}
		t = w.Template
	}
	return stream.Send(&pb.ImportTemplateResponse{Event: &pb.ImportTemplateResponse_Template{Template: templateToPB(t)}})
}

func (s *Server) WarmTemplate(ctx context.Context, req *pb.WarmTemplateRequest) (*pb.WarmTemplateResponse, error) {
	res, err := s.svc.WarmTemplate(ctx, req.TemplateId, req.Runtime)
	if err != nil {
		return nil, ToGRPC(err, "")
	}
	return &pb.WarmTemplateResponse{Template: templateToPB(res.Template), Timings: timingsToPB("warm", res.Timings)}, nil
}

func (s *Server) ListTemplates(ctx context.Context, _ *pb.ListTemplatesRequest) (*pb.ListTemplatesResponse, error) {
	at := time.Now()
	ts, err := s.svc.ListTemplates(ctx)
	if err != nil {
		return nil, ToGRPC(err, "")
	}
	out := &pb.ListTemplatesResponse{ListedAt: timestamppb.New(at)}
	for _, t := range ts {
		pt := templateToPB(t)
		pt.PoolReady = int32(s.svc.PoolReady(t.ID))
		out.Templates = append(out.Templates, pt)
	}
	return out, nil
}

func (s *Server) GetTemplate(ctx context.Context, req *pb.GetTemplateRequest) (*pb.GetTemplateResponse, error) {
	t, err := s.svc.GetTemplate(ctx, req.TemplateId)
	if err != nil {
		return nil, ToGRPC(err, "")
	}
	pt := templateToPB(t)
	pt.PoolReady = int32(s.svc.PoolReady(t.ID))
	return &pb.GetTemplateResponse{Template: pt}, nil
}

func (s *Server) DeleteTemplate(ctx context.Context, req *pb.DeleteTemplateRequest) (*pb.DeleteTemplateResponse, error) {
	if err := s.svc.DeleteTemplate(ctx, req.TemplateId); err != nil {
		return nil, ToGRPC(err, "")
	}
	return &pb.DeleteTemplateResponse{}, nil
}

func (s *Server) Info(ctx context.Context, _ *pb.InfoRequest) (*pb.InfoResponse, error) {
	info, err := s.svc.Info(ctx)
	if err != nil {
		return nil, ToGRPC(err, "")
	}
	out := &pb.InfoResponse{
		NodeId: info.NodeID, Hostname: info.Hostname, Version: info.Version,
		StorageMode: info.StorageMode, StorageDir: info.StorageDir,
		StorageTotalBytes: info.StorageTotal, StorageFreeBytes: info.StorageFree,
		Cpus: int32(info.CPUs), MemoryBytes: info.MemoryBytes,
		SandboxesByState: map[string]int32{}, Templates: int32(info.Templates),
	}
	for _, r := range info.Runtimes {
		out.Runtimes = append(out.Runtimes, &pb.RuntimeInfo{Name: r.Name, Pause: r.Pause, Checkpoint: r.Checkpoint, Restore: r.Restore,
			BootsDisk: r.BootsDisk, Detail: r.Detail})
	}
	for _, st := range lifecycle.All {
		if n := info.SandboxesByState[st]; n > 0 {
			out.SandboxesByState[string(st)] = int32(n)
		}
	}
	return out, nil
}

func (s *Server) Health(ctx context.Context, _ *pb.HealthRequest) (*pb.HealthResponse, error) {
	ok, conds := s.svc.Health(ctx)
	out := &pb.HealthResponse{Ok: ok}
	for _, c := range conds {
		out.Conditions = append(out.Conditions, &pb.Condition{Type: c.Type, Ok: c.OK, Message: c.Message})
	}
	return out, nil
}

func flowToPB(f cubelet.FlowInfo) *pb.Flow {
	out := &pb.Flow{Name: f.Name, Limit: int32(f.Limit), InFlight: int32(f.InFlight)}
	for _, st := range f.Steps {
		out.Steps = append(out.Steps, &pb.Step{Actions: st})
	}
	return out
}

func (s *Server) ListFlows(context.Context, *pb.ListFlowsRequest) (*pb.ListFlowsResponse, error) {
	out := &pb.ListFlowsResponse{}
	for _, f := range s.svc.Flows() {
		out.Flows = append(out.Flows, flowToPB(f))
	}
	return out, nil
}

func (s *Server) SetFlowLimit(_ context.Context, req *pb.SetFlowLimitRequest) (*pb.SetFlowLimitResponse, error) {
	f, err := s.svc.SetFlowLimit(req.Flow, int(req.Limit))
	if err != nil {
		return nil, ToGRPC(err, "")
	}
	return &pb.SetFlowLimitResponse{Flow: flowToPB(f)}, nil
}
