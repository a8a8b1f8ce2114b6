package cubeletapi_test

import (
	"context"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
)

// TestPauseModes: the request's mode reaches cubelet (DISK on runc is
// FailedPrecondition, an unknown mode InvalidArgument) and the sandbox
// reports how it is paused.
func TestPauseModes(t *testing.T) {
	env := cubelettest.New(t, "")
	c := serve(t, env)
	ctx := context.Background()
	if _, err := c.CreateSandbox(ctx, &pb.CreateSandboxRequest{SandboxId: "pm", TemplateId: "busybox", Runtime: "runc"}); err != nil {
		t.Fatal(err)
	}
	defer deleteSandbox(t, c, "pm")
	for mode, want := range map[pb.PauseMode]codes.Code{
		pb.PauseMode_PAUSE_MODE_DISK: codes.FailedPrecondition,
		pb.PauseMode(42):             codes.InvalidArgument,
	} {
		_, err := c.PauseSandbox(ctx, &pb.PauseSandboxRequest{SandboxId: "pm", Mode: mode})
		if status.Code(err) != want {
			t.Fatalf("pause mode %v: %v, want %v", mode, err, want)
		}
	}
	res, err := c.PauseSandbox(ctx, &pb.PauseSandboxRequest{SandboxId: "pm"})
	if err != nil || res.Sandbox.PauseMode != "memory" || res.Sandbox.State != pb.SandboxState_SANDBOX_STATE_PAUSED {
		t.Fatalf("pause (unspecified mode) = %v, %v; want paused in memory", res, err)
	}
	if len(res.Timings) == 0 || res.Timings[0].Flow != "pause" {
		t.Fatalf("pause timings %v: want flow pause", res.Timings)
	}
	rs, err := c.ResumeSandbox(ctx, &pb.ResumeSandboxRequest{SandboxId: "pm"})
	if err != nil || rs.Sandbox.PauseMode != "" || len(rs.Timings) == 0 || rs.Timings[0].Flow != "resume" {
		t.Fatalf("resume = %v, %v", rs, err)
	}
}
