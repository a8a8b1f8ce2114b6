package agenttest_test

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/agent/agenttest"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/nsdial"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// TestSandboxConformance runs the envd conformance suite against the real
// cube-agent: PID 1 of a busybox sandbox created by cubelet with runc,
// reached inside the sandbox's network namespace.
func TestSandboxConformance(t *testing.T) {
	env := cubelettest.New(t, "")
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	res, err := svc.Create(ctx, cubelet.CreateRequest{
		TemplateID: "busybox",
		Env:        map[string]string{"CUBE_CREATE_VAR": "from create"},
		Resources:  sandbox.Resources{MilliCPU: 1000, MemoryMiB: 256, Pids: 512},
	})
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	id := res.Sandbox.ID
	netns := fmt.Sprintf("/proc/%d/ns/net", res.Sandbox.Container.PID)
	t.Run("Suite", func(t *testing.T) {
		agenttest.Run(t, agenttest.Target{
			URL: fmt.Sprintf("http://127.0.0.1:%d", agentproto.Port),
			Dial: func(ctx context.Context, network, addr string) (net.Conn, error) {
				return nsdial.DialContext(ctx, netns, network, addr)
			},
			UserHome: "/home/user",
			RootOnly: "/root",
			Env:      map[string]string{"CUBE_CREATE_VAR": "from create", "CUBE_SANDBOX_ID": id},
			Sandbox:  true,
		})
	})
	if _, err := svc.Delete(context.Background(), id); err != nil {
		t.Fatalf("delete: %v", err)
	}
	env.AssertNoLeaks(t)
}
