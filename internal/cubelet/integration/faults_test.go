package integration

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/agentclient"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/lifecycle"
)

// points lists the failpoints of every action of a flow: before it runs
// and after it did its work (so the undo must clean up a finished action).
func points(svc *cubelet.Service, flow string) []string {
	var out []string
	for _, f := range svc.Flows() {
		if f.Name != flow {
			continue
		}
		for _, step := range f.Steps {
			for _, a := range step {
				out = append(out, flow+"/"+a, flow+"/"+a+"/after")
			}
		}
	}
	return out
}

func inject(t *testing.T, name, spec string) {
	t.Helper()
	if err := failpoint.Enable(name, spec); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { failpoint.Disable(name) })
}

func TestFaultInjection(t *testing.T) {
	env := cubelettest.New(t, "")
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()
	create := func(t *testing.T) string {
		t.Helper()
		res, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox"})
		if err != nil {
			t.Fatalf("create: %v", err)
		}
		return res.Sandbox.ID
	}

	t.Run("create", func(t *testing.T) {
		for _, p := range points(svc, cubelet.FlowCreate) {
			t.Run(p, func(t *testing.T) {
				inject(t, p, "1*error")
				_, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox"})
				if !errors.Is(err, failpoint.ErrInjected) {
					t.Fatalf("want injected error, got %v", err)
				}
				if l, _ := svc.List(ctx, cubelet.ListFilter{}); len(l) != 0 {
					t.Fatalf("failed create left records: %+v", l)
				}
				env.AssertNoLeaks(t)
			})
		}
	})

	t.Run("pause", func(t *testing.T) {
		id := create(t)
		cleanupDelete(t, svc, id)
		for _, p := range points(svc, cubelet.FlowPause) {
			t.Run(p, func(t *testing.T) {
				inject(t, p, "1*error")
				if _, err := svc.Pause(ctx, id); !errors.Is(err, failpoint.ErrInjected) {
					t.Fatalf("want injected error, got %v", err)
				}
				sb, _ := svc.Get(ctx, id)
				if sb.State != lifecycle.Running || freezerState(t, env, id) != "THAWED" {
					t.Fatalf("after failed pause: state %s, freezer %s", sb.State, freezerState(t, env, id))
				}
				if err := agentclient.WaitAgent(ctx, sb.Container.PID); err != nil {
					t.Fatalf("agent after failed pause: %v", err)
				}
			})
		}
	})

	t.Run("resume", func(t *testing.T) {
		id := create(t)
		cleanupDelete(t, svc, id)
		if _, err := svc.Pause(ctx, id); err != nil {
			t.Fatal(err)
		}
		for _, p := range points(svc, cubelet.FlowResume) {
			t.Run(p, func(t *testing.T) {
				inject(t, p, "1*error")
				if _, err := svc.Resume(ctx, id); !errors.Is(err, failpoint.ErrInjected) {
					t.Fatalf("want injected error, got %v", err)
				}
				sb, _ := svc.Get(ctx, id)
				if sb.State != lifecycle.Paused || freezerState(t, env, id) != "FROZEN" {
					t.Fatalf("after failed resume: state %s, freezer %s", sb.State, freezerState(t, env, id))
				}
			})
		}
		if _, err := svc.Resume(ctx, id); err != nil {
			t.Fatalf("resume after the faults: %v", err)
		}
	})

	t.Run("destroy", func(t *testing.T) {
		for _, p := range points(svc, cubelet.FlowDestroy) {
			t.Run(p, func(t *testing.T) {
				// A destroy that fails, and whose first retry fails too,
				// succeeds within Delete's own brief retries: the client
				// is not told a kill failed that finishes a moment later.
				id := create(t)
				inject(t, p, "1*error")
				inject(t, "cleanup/"+p[len("destroy/"):], "1*error")
				if _, err := svc.Delete(ctx, id); err != nil {
					t.Fatalf("delete with two transient failures: %v", err)
				}
				if _, err := svc.Get(ctx, id); err == nil {
					t.Fatal("deleted sandbox still there")
				}
				env.AssertNoLeaks(t)

				// One that keeps failing is journalled: Delete answers the
				// error, and the journalled retry (whose first attempt
				// fails too, so the backoff path runs) finishes it.
				id = create(t)
				inject(t, p, "1*error")
				inject(t, "cleanup/"+p[len("destroy/"):], "5*error")
				_, err := svc.Delete(ctx, id)
				if !errors.Is(err, failpoint.ErrInjected) {
					t.Fatalf("want injected error, got %v", err)
				}
				if sb, err := svc.Get(ctx, id); err == nil && sb.State != lifecycle.Destroying {
					t.Fatalf("after failed destroy: %s", sb.State)
				}
				waitGone(t, svc, id, 20*time.Second)
				env.AssertNoLeaks(t)
			})
		}
	})
}

func waitGone(t *testing.T, svc *cubelet.Service, id string, d time.Duration) {
	t.Helper()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if _, err := svc.Get(context.Background(), id); err != nil {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	sb, _ := svc.Get(context.Background(), id)
	t.Fatalf("sandbox %s still there after %s: %+v", id, d, sb)
}
