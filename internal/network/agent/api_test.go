package agent_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/agent"
	"github.com/cubesandbox/cube/internal/network/agentapi"
	"github.com/cubesandbox/cube/internal/network/client"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/network/policy"

	pb "github.com/cubesandbox/cube/api/network/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// TestBadConfig: every bad config is a clear InvalidArgument from New, and
// nothing is created on the host (not even the state directory).
func TestBadConfig(t *testing.T) {
	nettest.RequireRoot(t)
	for _, c := range []struct {
		name string
		mod  func(c *agent.Config)
		msg  string
	}{
		{"garbage CIDR", func(c *agent.Config) { c.NodeCIDR = "nope" }, "node_cidr"},
		{"bad mask", func(c *agent.Config) { c.NodeCIDR = "10.0.0.0/33" }, "node_cidr"},
		{"host bits", func(c *agent.Config) { c.NodeCIDR = "10.200.0.1/16" }, "did you mean 10.200.0.0/16"},
		{"IPv6", func(c *agent.Config) { c.NodeCIDR = "fd00::/64" }, "not IPv4"},
		{"link-local overlap", func(c *agent.Config) { c.NodeCIDR = "169.254.0.0/20" }, "overlaps 169.254.0.0/16"},
		{"smaller than a slot", func(c *agent.Config) { c.NodeCIDR = "10.200.0.0/31" }, "smaller than one /30"},
		{"pool larger than the CIDR", func(c *agent.Config) { c.NodeCIDR = "10.200.0.0/28"; c.Pool.Size = 3; c.Pool.VMSize = 2 }, "larger than node_cidr"},
		{"bad prefix", func(c *agent.Config) { c.Prefix = "Cube_1" }, "prefix"},
		{"long prefix", func(c *agent.Config) { c.Prefix = "abcdefghi" }, "prefix"},
		{"relative dir", func(c *agent.Config) { c.DataDir = "state" }, "absolute"},
		{"no refill", func(c *agent.Config) { c.Pool.RefillPerSecond = 0 }, "refill"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := agent.Defaults()
			dir := t.TempDir()
			cfg.RunDir, cfg.DataDir = filepath.Join(dir, "run"), filepath.Join(dir, "data")
			cfg.Prefix = "ntbad"
			c.mod(cfg)
			_, err := agent.New(ctx, cfg, nil)
			if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), c.msg) {
				t.Fatalf("got %v, want InvalidArgument mentioning %q", err, c.msg)
			}
			if _, err := os.Stat(filepath.Join(dir, "data")); err == nil {
				t.Error("a refused config created the state directory")
			}
		})
	}
	if _, err := agent.ParseConfig([]byte("node_cidrr = \"10.0.0.0/8\"")); !errdefs.IsInvalidArgument(err) {
		t.Errorf("unknown key: %v", err)
	}
}

// TestOverlappingCIDR: a node CIDR that overlaps a network the host
// already routes (here another agent's slots) is refused before anything
// is made.
func TestOverlappingCIDR(t *testing.T) {
	first := nettest.Start(t, nettest.Options{})
	ensure(t, first.Agent, "ov-1", network.Container, policy.Policy{})
	defer releaseAll(t, first.Agent)
	cfg, dir := nettest.NewConfig(t, nettest.Options{})
	defer os.RemoveAll(dir)
	cfg.NodeCIDR = first.Config.NodeCIDR
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	_, err := agent.New(ctx, cfg, nil)
	if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "overlaps route") {
		t.Fatalf("got %v", err)
	}
	if _, err := os.Stat(cfg.DataDir); err == nil {
		t.Error("state directory created")
	}
	second := &nettest.Env{Config: cfg}
	second.AssertNoLeaks(t) // no host table, no links of its prefix
}

func grpcCode(err error) codes.Code { return status.Code(err) }

// TestAPI drives the agent through its gRPC socket: the error codes of bad
// requests, a CIDR running out, and the HTTP endpoints.
func TestAPI(t *testing.T) {
	e := nettest.Start(t, nettest.Options{CIDRBits: 29, Serve: true}) // 2 slots
	conn, err := grpc.NewClient("unix://"+e.Socket, grpc.WithTransportCredentials(insecureCreds()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	api := pb.NewNetworkAgentClient(conn)
	no := false
	for _, c := range []struct {
		name string
		req  *pb.EnsureNetworkRequest
		code codes.Code
		msg  string
	}{
		{"bad id", &pb.EnsureNetworkRequest{SandboxId: "Bad_ID"}, codes.InvalidArgument, "sandbox id"},
		{"bad kind", &pb.EnsureNetworkRequest{SandboxId: "k", Kind: 7}, codes.OK, ""},
		{"invalid CIDR", &pb.EnsureNetworkRequest{SandboxId: "x", Policy: &pb.Policy{AllowOut: []string{"1.2.3.0/40"}}}, codes.InvalidArgument, "policy.allow_out[0]"},
		{"overlapping CIDRs", &pb.EnsureNetworkRequest{SandboxId: "x", Policy: &pb.Policy{DenyOut: []string{"8.0.0.0/8", "8.8.8.8"}}}, codes.InvalidArgument, "8.8.8.8/32 overlaps 8.0.0.0/8"},
		{"metadata", &pb.EnsureNetworkRequest{SandboxId: "x", Policy: &pb.Policy{AllowOut: []string{"169.254.169.254"}}}, codes.InvalidArgument, "no sandbox may reach"},
		{"negative limit", &pb.EnsureNetworkRequest{SandboxId: "x", Policy: &pb.Policy{MaxConnections: -1}}, codes.InvalidArgument, "max_connections"},
	} {
		_, err := api.EnsureNetwork(ctx, c.req)
		if grpcCode(err) != c.code || (c.msg != "" && !strings.Contains(err.Error(), c.msg)) {
			t.Errorf("%s: got %v, want %s %q", c.name, err, c.code, c.msg)
		}
	}
	// An unknown kind is treated as a container (proto3 forward compat):
	// the request above made "k"; a second one with other parameters is
	// AlreadyExists.
	_, err = api.EnsureNetwork(ctx, &pb.EnsureNetworkRequest{SandboxId: "k", Policy: &pb.Policy{AllowInternetAccess: &no}})
	if grpcCode(err) != codes.AlreadyExists || !strings.Contains(err.Error(), "UpdatePolicy") {
		t.Errorf("second ensure with another policy: %v", err)
	}
	if _, err := api.EnsureNetwork(ctx, &pb.EnsureNetworkRequest{SandboxId: "k2"}); err != nil {
		t.Fatal(err)
	}
	before := slotDebris(t, e)
	_, err = api.EnsureNetwork(ctx, &pb.EnsureNetworkRequest{SandboxId: "k3"})
	if grpcCode(err) != codes.ResourceExhausted {
		t.Errorf("third slot of a /29: %v", err)
	}
	if after := slotDebris(t, e); after != before {
		t.Errorf("a refused ensure changed the host: %d slot objects before, %d after", before, after)
	}
	if _, err := api.UpdatePolicy(ctx, &pb.UpdatePolicyRequest{SandboxId: "nope", Policy: &pb.Policy{}}); grpcCode(err) != codes.NotFound {
		t.Errorf("update unknown: %v", err)
	}
	if _, err := api.GetNetwork(ctx, &pb.GetNetworkRequest{SandboxId: "nope"}); grpcCode(err) != codes.NotFound {
		t.Errorf("get unknown: %v", err)
	}
	if r, err := api.ReleaseNetwork(ctx, &pb.ReleaseNetworkRequest{SandboxId: "nope"}); err != nil || r.Released {
		t.Errorf("release unknown: %v %v", r, err)
	}
	if r, err := api.ListNetworks(ctx, &pb.ListNetworksRequest{}); err != nil || len(r.Networks) != 2 {
		t.Errorf("list: %v %v", r, err)
	}
	if r, err := api.Reconcile(ctx, &pb.ReconcileRequest{}); err != nil || r.Adopted != 2 {
		t.Errorf("reconcile: %v %v", r, err)
	}

	// The typed client maps codes back to errdefs.
	cl, err := client.Dial(e.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if _, err := cl.Get(ctx, "nope"); !errdefs.IsNotFound(err) {
		t.Errorf("client get: %v", err)
	}
	n, err := cl.Get(ctx, "k2")
	if err != nil || n.SandboxIP != "169.254.0.21" || !n.Policy.InternetAllowed() {
		t.Errorf("client get k2: %+v %v", n, err)
	}
	h, err := cl.Health(ctx)
	if err != nil || !h.Ok || h.SlotsInUse != 2 || h.SlotsFree != 0 {
		t.Errorf("health: %v %v", h, err)
	}

	srv := httptest.NewServer(agentapi.HTTPHandler(e.Agent))
	defer srv.Close()
	for path, want := range map[string]string{"/healthz": "", "/readyz": "2 slots in use", "/metrics": `network_agent_slots{state="assigned"} 2`} {
		resp, err := http.Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode/100 != 2 || !strings.Contains(string(body), want) {
			t.Errorf("%s: %s %q", path, resp.Status, body)
		}
	}
	releaseAll(t, e.Agent)
}

func insecureCreds() credentials.TransportCredentials { return insecure.NewCredentials() }
