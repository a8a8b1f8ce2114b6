package nodeapi_test

import (
	"context"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/master/mastertest"
)

// TestAuthAndValidation checks the node token and the report validation
// at the gRPC edge of a real master.
func TestAuthAndValidation(t *testing.T) {
	m := mastertest.StartMaster(t, "[nodes]\ntoken = \"n0de\"\n")
	conn, err := grpc.NewClient("unix://"+m.Socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	nodes := masterpb.NewNodeServiceClient(conn)
	report := &masterpb.NodeReport{NodeId: "n1", Address: "unix:///nonexistent.sock", Ok: true}
	ctx := context.Background()
	withToken := func(tok string) context.Context {
		return metadata.AppendToOutgoingContext(ctx, masterpb.NodeTokenHeader, tok)
	}

	for name, c := range map[string]context.Context{"no token": ctx, "wrong token": withToken("nope")} {
		if _, err := nodes.Register(c, &masterpb.RegisterRequest{Node: report}); status.Code(err) != codes.Unauthenticated {
			t.Errorf("%s: %v", name, err)
		}
	}
	// A heartbeat from a node the master does not know asks it to register.
	hb, err := nodes.Heartbeat(withToken("n0de"), &masterpb.HeartbeatRequest{Node: report})
	if err != nil || hb.Registered {
		t.Fatalf("heartbeat before register: %+v %v", hb, err)
	}
	reg, err := nodes.Register(withToken("n0de"), &masterpb.RegisterRequest{Node: report})
	if err != nil || reg.HeartbeatInterval.AsDuration() <= 0 {
		t.Fatalf("register: %+v %v", reg, err)
	}
	if hb, err := nodes.Heartbeat(withToken("n0de"), &masterpb.HeartbeatRequest{Node: report}); err != nil || !hb.Registered {
		t.Fatalf("heartbeat after register: %+v %v", hb, err)
	}
	for _, bad := range []*masterpb.NodeReport{nil, {NodeId: "", Address: "x"}, {NodeId: "bad id!", Address: "x"}, {NodeId: "n2"}} {
		if _, err := nodes.Register(withToken("n0de"), &masterpb.RegisterRequest{Node: bad}); status.Code(err) != codes.InvalidArgument {
			t.Errorf("report %+v: %v", bad, err)
		}
	}
	// The admin API on the socket needs no token; it lists the node.
	resp, err := m.Admin.ListNodes(ctx, &masterpb.ListNodesRequest{})
	if err != nil || len(resp.Nodes) != 1 || resp.Nodes[0].Report.NodeId != "n1" || !resp.Nodes[0].Healthy {
		t.Fatalf("list nodes: %+v %v", resp, err)
	}
	if _, err := m.Admin.CreateAPIKey(ctx, &masterpb.CreateAPIKeyRequest{Name: "bad name!"}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("bad key name: %v", err)
	}
}
