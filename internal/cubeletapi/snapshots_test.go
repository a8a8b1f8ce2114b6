package cubeletapi_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/errdefs/grpcerr"
)

// TestSnapshotRPCs drives snapshot, clone, rollback and host mounts over
// the real gRPC server and checks their status codes and error details.
func TestSnapshotRPCs(t *testing.T) {
	hostDir := t.TempDir()
	env := cubelettest.New(t, "[[storage.host_mount_allow]]\nprefix = \""+hostDir+"\"\nread_only = true\n")
	c := serve(t, env)
	ctx := context.Background()
	if err := os.WriteFile(filepath.Join(hostDir, "f"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	sb, err := c.CreateSandbox(ctx, &pb.CreateSandboxRequest{SandboxId: "rpc", TemplateId: "busybox",
		HostMounts: []*pb.HostMount{{Source: hostDir, Destination: "/host", ReadOnly: true}}})
	if err != nil {
		t.Fatal(err)
	}
	if hm := sb.Sandbox.HostMounts; len(hm) != 1 || hm[0].Destination != "/host" || !hm[0].ReadOnly {
		t.Fatalf("host mounts in the response: %+v", hm)
	}
	snap, err := c.SnapshotSandbox(ctx, &pb.SnapshotSandboxRequest{SandboxId: "rpc", SnapshotId: "rpc-snap", Name: "n", Labels: map[string]string{"a": "b"}})
	if err != nil {
		t.Fatal(err)
	}
	if s := snap.Snapshot; s.Id != "rpc-snap" || s.SandboxId != "rpc" || s.TemplateId != "busybox" || s.HasMemory || s.SizeBytes == 0 || s.Runtime != "runc" || len(snap.Timings) == 0 {
		t.Fatalf("snapshot response: %+v", snap)
	}
	list, err := c.ListSnapshots(ctx, &pb.ListSnapshotsRequest{Labels: map[string]string{"a": "b"}})
	if err != nil || len(list.Snapshots) != 1 {
		t.Fatalf("list: %v %v", list, err)
	}
	cl, err := c.CloneSandbox(ctx, &pb.CloneSandboxRequest{SnapshotId: "rpc-snap", Count: 2, SandboxIds: []string{"rpc-c1", "rpc-c2"}})
	if err != nil || len(cl.Sandboxes) != 2 || cl.Sandboxes[1].SourceSnapshotId != "rpc-snap" {
		t.Fatalf("clone: %v %v", cl, err)
	}
	rb, err := c.RollbackSandbox(ctx, &pb.RollbackSandboxRequest{SandboxId: "rpc", SnapshotId: "rpc-snap"})
	if err != nil || rb.Sandbox.SourceSnapshotId != "rpc-snap" || rb.Sandbox.State != pb.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("rollback: %v %v", rb, err)
	}

	for _, tc := range []struct {
		name  string
		err   error
		code  codes.Code
		field string
	}{
		{"get unknown", err2(c.GetSnapshot(ctx, &pb.GetSnapshotRequest{SnapshotId: "nope"})), codes.NotFound, ""},
		{"snapshot bad id", err2(c.SnapshotSandbox(ctx, &pb.SnapshotSandboxRequest{SandboxId: "rpc", SnapshotId: "BAD"})), codes.InvalidArgument, "snapshot_id"},
		{"snapshot dup", err2(c.SnapshotSandbox(ctx, &pb.SnapshotSandboxRequest{SandboxId: "rpc", SnapshotId: "rpc-snap"})), codes.AlreadyExists, ""},
		{"clone count", err2(c.CloneSandbox(ctx, &pb.CloneSandboxRequest{SnapshotId: "rpc-snap", Count: 101})), codes.InvalidArgument, "count"},
		{"clone bad network", err2(c.CloneSandbox(ctx, &pb.CloneSandboxRequest{SnapshotId: "rpc-snap", Count: 1, Network: &pb.NetworkPolicy{AllowOut: []string{"not-a-cidr"}}})), codes.InvalidArgument, "network.allow_out[0]"},
		{"rollback unknown", err2(c.RollbackSandbox(ctx, &pb.RollbackSandboxRequest{SandboxId: "rpc", SnapshotId: "nope"})), codes.NotFound, ""},
		{"host mount rw under ro rule", err2(c.CreateSandbox(ctx, &pb.CreateSandboxRequest{TemplateId: "busybox",
			HostMounts: []*pb.HostMount{{Source: hostDir, Destination: "/host"}}})), codes.InvalidArgument, "host_mounts[0].source"},
		{"template in use by snapshots", err2(c.DeleteTemplate(ctx, &pb.DeleteTemplateRequest{TemplateId: "busybox"})), codes.FailedPrecondition, ""},
	} {
		if st, _ := status.FromError(tc.err); st.Code() != tc.code {
			t.Errorf("%s: code %v, want %v (%v)", tc.name, st.Code(), tc.code, tc.err)
		}
		if d := grpcerr.Detail(tc.err); tc.field != "" && (d == nil || d.Field != tc.field) {
			t.Errorf("%s: detail %+v, want field %s", tc.name, d, tc.field)
		}
	}

	for _, id := range []string{"rpc", "rpc-c1", "rpc-c2"} {
		if _, err := c.DeleteSandbox(ctx, &pb.DeleteSandboxRequest{SandboxId: id}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.DeleteSnapshot(ctx, &pb.DeleteSnapshotRequest{SnapshotId: "rpc-snap"}); err != nil {
		t.Fatal(err)
	}
	env.AssertNoLeaks(t)
}

func err2[T any](_ T, err error) error { return err }
