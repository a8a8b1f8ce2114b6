package cubeletapi_test

import (
	"context"
	"log/slog"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/cubeletapi"
	"github.com/cubesandbox/cube/internal/cubeletclient"
	"github.com/cubesandbox/cube/internal/errdefs/grpcerr"
)

// serve runs the real gRPC server on a unix socket in the env and returns
// a client over it.
func serve(t *testing.T, env *cubelettest.Env) pb.CubeletServiceClient {
	t.Helper()
	env.Config.API.Socket = filepath.Join(env.Dir, "api.sock")
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = cubeletapi.Serve(ctx, svc, slog.Default()); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	conn, err := cubeletclient.Dial(env.Config.API.Socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	c := cubeletclient.New(conn)
	for i := 0; ; i++ {
		if _, err := c.Health(context.Background(), &pb.HealthRequest{}); err == nil {
			return c
		} else if i > 100 {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// deleteSandbox deletes sandbox id unless it is already gone: the tests
// defer it as a safety net.
func deleteSandbox(t *testing.T, c pb.CubeletServiceClient, id string) {
	t.Helper()
	_, err := c.DeleteSandbox(context.Background(), &pb.DeleteSandboxRequest{SandboxId: id})
	if err != nil && status.Code(err) != codes.NotFound {
		t.Errorf("delete %s: %v", id, err)
	}
}

func TestErrorCodes(t *testing.T) {
	env := cubelettest.New(t, "")
	c := serve(t, env)
	ctx := context.Background()
	if _, err := c.CreateSandbox(ctx, &pb.CreateSandboxRequest{SandboxId: "one", TemplateId: "busybox"}); err != nil {
		t.Fatal(err)
	}
	defer deleteSandbox(t, c, "one")
	if _, err := c.PauseSandbox(ctx, &pb.PauseSandboxRequest{SandboxId: "one"}); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name  string
		call  func() error
		code  codes.Code
		field string
		state pb.SandboxState
	}{
		{"bad id", func() error {
			_, err := c.CreateSandbox(ctx, &pb.CreateSandboxRequest{SandboxId: "NO!", TemplateId: "busybox"})
			return err
		}, codes.InvalidArgument, "sandbox_id", 0},
		{"unknown template", func() error {
			_, err := c.CreateSandbox(ctx, &pb.CreateSandboxRequest{TemplateId: "ghost"})
			return err
		}, codes.NotFound, "", 0},
		{"negative memory", func() error {
			_, err := c.CreateSandbox(ctx, &pb.CreateSandboxRequest{TemplateId: "busybox", Resources: &pb.Resources{MemoryMib: -1}})
			return err
		}, codes.InvalidArgument, "resources.memory_mib", 0},
		{"oversized cpu", func() error {
			_, err := c.CreateSandbox(ctx, &pb.CreateSandboxRequest{TemplateId: "busybox", Resources: &pb.Resources{MilliCpu: 1 << 40}})
			return err
		}, codes.InvalidArgument, "resources.milli_cpu", 0},
		{"duplicate", func() error {
			_, err := c.CreateSandbox(ctx, &pb.CreateSandboxRequest{SandboxId: "one", TemplateId: "busybox"})
			return err
		}, codes.AlreadyExists, "", 0},
		{"get missing", func() error {
			_, err := c.GetSandbox(ctx, &pb.GetSandboxRequest{SandboxId: "missing"})
			return err
		}, codes.NotFound, "", 0},
		{"pause paused", func() error {
			_, err := c.PauseSandbox(ctx, &pb.PauseSandboxRequest{SandboxId: "one"})
			return err
		}, codes.FailedPrecondition, "", pb.SandboxState_SANDBOX_STATE_PAUSED},
		{"list bad state", func() error {
			_, err := c.ListSandboxes(ctx, &pb.ListSandboxesRequest{States: []pb.SandboxState{99}})
			return err
		}, codes.InvalidArgument, "states", 0},
		{"unknown flow", func() error {
			_, err := c.SetFlowLimit(ctx, &pb.SetFlowLimitRequest{Flow: "nope", Limit: 1})
			return err
		}, codes.NotFound, "", 0},
		{"negative limit", func() error {
			_, err := c.SetFlowLimit(ctx, &pb.SetFlowLimitRequest{Flow: "create", Limit: -1})
			return err
		}, codes.InvalidArgument, "", 0},
		{"template missing", func() error {
			_, err := c.GetTemplate(ctx, &pb.GetTemplateRequest{TemplateId: "ghost"})
			return err
		}, codes.NotFound, "", 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.call()
			if status.Code(err) != tc.code {
				t.Fatalf("want %s, got %v", tc.code, err)
			}
			d := grpcerr.Detail(err)
			if d == nil || d.Reason != tc.code.String() {
				t.Fatalf("missing or wrong ErrorDetail: %+v", d)
			}
			if d.Field != tc.field {
				t.Errorf("field = %q, want %q", d.Field, tc.field)
			}
			if d.CurrentState != tc.state {
				t.Errorf("current state = %s, want %s", d.CurrentState, tc.state)
			}
		})
	}
}

// TestConcurrentCreatesLimited fires 50 creates at a create limit of 10:
// some are refused at once with ResourceExhausted, none hang, the rest
// succeed, and after deleting them nothing is left.
func TestConcurrentCreatesLimited(t *testing.T) {
	env := cubelettest.New(t, "")
	c := serve(t, env)
	ctx := context.Background()
	if _, err := c.SetFlowLimit(ctx, &pb.SetFlowLimitRequest{Flow: "create", Limit: 10}); err != nil {
		t.Fatal(err)
	}
	var ok, exhausted atomic.Int32
	var wg sync.WaitGroup
	var mu sync.Mutex
	var created []string
	start := make(chan struct{})
	for range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			cctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
			defer cancel()
			t0 := time.Now()
			resp, err := c.CreateSandbox(cctx, &pb.CreateSandboxRequest{TemplateId: "busybox", Resources: &pb.Resources{MemoryMib: 32}})
			switch status.Code(err) {
			case codes.OK:
				ok.Add(1)
				mu.Lock()
				created = append(created, resp.Sandbox.Id)
				mu.Unlock()
			case codes.ResourceExhausted:
				exhausted.Add(1)
				if d := time.Since(t0); d > 2*time.Second {
					t.Errorf("ResourceExhausted took %s: the limiter queued", d)
				}
			default:
				t.Errorf("create: %v", err)
			}
		}()
	}
	close(start)
	wg.Wait()
	t.Logf("%d created, %d refused", ok.Load(), exhausted.Load())
	if exhausted.Load() == 0 || ok.Load() == 0 || ok.Load()+exhausted.Load() != 50 {
		t.Errorf("want some of each: %d ok, %d exhausted", ok.Load(), exhausted.Load())
	}
	flows, _ := c.ListFlows(ctx, &pb.ListFlowsRequest{})
	for _, f := range flows.Flows {
		if f.InFlight != 0 {
			t.Errorf("flow %s still has %d in flight", f.Name, f.InFlight)
		}
	}
	list, _ := c.ListSandboxes(ctx, &pb.ListSandboxesRequest{})
	if len(list.Sandboxes) != int(ok.Load()) {
		t.Errorf("%d sandboxes listed, %d created", len(list.Sandboxes), ok.Load())
	}
	for _, id := range created {
		if _, err := c.DeleteSandbox(ctx, &pb.DeleteSandboxRequest{SandboxId: id}); err != nil {
			t.Errorf("delete %s: %v", id, err)
		}
	}
	env.AssertNoLeaks(t)
}
