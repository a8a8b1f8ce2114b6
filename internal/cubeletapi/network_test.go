package cubeletapi_test

import (
	"context"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/errdefs/grpcerr"
	"github.com/cubesandbox/cube/internal/network/nettest"
)

// TestNetworkAPI: a create request's policy reaches the sandbox's slot,
// GetSandbox reports where it sits, UpdateSandboxNetwork replaces the
// policy, and bad policies are InvalidArgument naming the field.
func TestNetworkAPI(t *testing.T) {
	env := cubelettest.New(t, "")
	env.StartNetworkAgent(t, nettest.Options{})
	c := serve(t, env)
	ctx := context.Background()
	no := false
	res, err := c.CreateSandbox(ctx, &pb.CreateSandboxRequest{SandboxId: "net", TemplateId: "busybox",
		Network: &pb.NetworkPolicy{AllowInternetAccess: &no, AllowOut: []string{"198.51.100.7"}}})
	if err != nil {
		t.Fatal(err)
	}
	defer deleteSandbox(t, c, "net")
	n := res.Sandbox.Network
	if n == nil || n.HostIp == "" || n.SandboxIp != "169.254.0.21" || n.Netns == "" ||
		n.Policy.GetAllowInternetAccess() || len(n.Policy.AllowOut) != 1 || n.Policy.AllowOut[0] != "198.51.100.7/32" {
		t.Fatalf("network info: %v", n)
	}

	up, err := c.UpdateSandboxNetwork(ctx, &pb.UpdateSandboxNetworkRequest{SandboxId: "net",
		Policy: &pb.NetworkPolicy{DenyOut: []string{"203.0.113.0/24"}, MaxConnections: 50}})
	if err != nil {
		t.Fatal(err)
	}
	if p := up.Sandbox.Network.Policy; p.AllowInternetAccess != nil || len(p.DenyOut) != 1 || p.MaxConnections != 50 {
		t.Fatalf("updated policy: %v", p)
	}

	for _, tc := range []struct {
		name  string
		call  func() error
		code  codes.Code
		field string
	}{
		{"create with an invalid CIDR", func() error {
			_, err := c.CreateSandbox(ctx, &pb.CreateSandboxRequest{TemplateId: "busybox", Network: &pb.NetworkPolicy{DenyOut: []string{"10.0.0.0/8", "300.1.1.1"}}})
			return err
		}, codes.InvalidArgument, "network.deny_out[1]"},
		{"create with overlapping CIDRs", func() error {
			_, err := c.CreateSandbox(ctx, &pb.CreateSandboxRequest{TemplateId: "busybox", Network: &pb.NetworkPolicy{AllowOut: []string{"1.0.0.0/8", "1.2.0.0/16"}}})
			return err
		}, codes.InvalidArgument, "network.allow_out"},
		{"update without a policy", func() error {
			_, err := c.UpdateSandboxNetwork(ctx, &pb.UpdateSandboxNetworkRequest{SandboxId: "net"})
			return err
		}, codes.InvalidArgument, "policy"},
		{"update with a bad limit", func() error {
			_, err := c.UpdateSandboxNetwork(ctx, &pb.UpdateSandboxNetworkRequest{SandboxId: "net", Policy: &pb.NetworkPolicy{EgressKbps: -5}})
			return err
		}, codes.InvalidArgument, "policy.egress_kbps"},
		{"update of an unknown sandbox", func() error {
			_, err := c.UpdateSandboxNetwork(ctx, &pb.UpdateSandboxNetworkRequest{SandboxId: "nope", Policy: &pb.NetworkPolicy{}})
			return err
		}, codes.NotFound, ""},
	} {
		err := tc.call()
		if status.Code(err) != tc.code {
			t.Errorf("%s: got %v, want %s", tc.name, err, tc.code)
			continue
		}
		if d := grpcerr.Detail(err); tc.field != "" && (d == nil || d.Field != tc.field) {
			t.Errorf("%s: detail %v, want field %q", tc.name, d, tc.field)
		}
	}
	if _, err := c.DeleteSandbox(ctx, &pb.DeleteSandboxRequest{SandboxId: "net"}); err != nil {
		t.Fatal(err)
	}
}
