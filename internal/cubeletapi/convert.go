package cubeletapi

import (
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/workflow"
)

var statePB = map[lifecycle.State]pb.SandboxState{
	lifecycle.Creating:     pb.SandboxState_SANDBOX_STATE_CREATING,
	lifecycle.Running:      pb.SandboxState_SANDBOX_STATE_RUNNING,
	lifecycle.Paused:       pb.SandboxState_SANDBOX_STATE_PAUSED,
	lifecycle.Snapshotting: pb.SandboxState_SANDBOX_STATE_SNAPSHOTTING,
	lifecycle.Destroying:   pb.SandboxState_SANDBOX_STATE_DESTROYING,
	lifecycle.Destroyed:    pb.SandboxState_SANDBOX_STATE_DESTROYED,
	lifecycle.Failed:       pb.SandboxState_SANDBOX_STATE_FAILED,
	lifecycle.Unknown:      pb.SandboxState_SANDBOX_STATE_UNKNOWN,
}

func stateToPB(s lifecycle.State) pb.SandboxState { return statePB[s] }

// StateFromPB maps an API state to the lifecycle state ("" if unknown).
func StateFromPB(s pb.SandboxState) lifecycle.State {
	for k, v := range statePB {
		if v == s {
			return k
		}
	}
	return ""
}

func sandboxToPB(r *sandbox.Record) *pb.Sandbox {
	if r == nil {
		return nil
	}
	out := &pb.Sandbox{
		Id: r.ID, TemplateId: r.TemplateID, State: stateToPB(r.State), Runtime: r.Runtime,
		Labels: r.Labels, Annotations: r.Annotations, Env: r.Env,
		Resources: &pb.Resources{
			MilliCpu: r.Resources.MilliCPU, MemoryMib: r.Resources.MemoryMiB,
			Pids: r.Resources.Pids, DiskMib: r.Resources.DiskMiB,
		},
		CreatedAt: timestamppb.New(r.CreatedAt), UpdatedAt: timestamppb.New(r.UpdatedAt),
		Error: r.Error,
	}
	if r.Container != nil {
		out.Pid = int32(r.Container.PID)
	}
	out.SourceSnapshotId = r.SourceSnapshotID
	out.PauseMode = string(r.PauseMode)
	out.HostMounts = hostMountsToPB(r.HostMounts)
	out.Network = networkToPB(r)
	return out
}

func templateToPB(t *sandbox.Template) *pb.Template {
	return &pb.Template{
		Id: t.ID, Digest: t.Digest, Source: t.Source, SizeBytes: t.SizeBytes,
		Entrypoint: t.Entrypoint, Cmd: t.Cmd, Env: t.Env, WorkingDir: t.WorkingDir, User: t.User,
		CreatedAt: timestamppb.New(t.CreatedAt), Runtime: t.Runtime,
		Warm: t.WarmSnapshotID != "", WarmSnapshotId: t.WarmSnapshotID,
	}
}

func timingsToPB(flow string, ts []workflow.Timing) []*pb.ActionTiming {
	out := make([]*pb.ActionTiming, 0, len(ts))
	for _, t := range ts {
		out = append(out, &pb.ActionTiming{
			Flow: flow, Step: int32(t.Step), Action: t.Action, Phase: t.Phase,
			Duration: durationpb.New(t.Duration), Error: t.Err,
		})
	}
	return out
}
