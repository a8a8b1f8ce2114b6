package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/testenv"
)

// agentURL is the agent of sb through its network slot: a gVisor sandbox
// runs its own network stack, so only the slot's address reaches it.
func agentURL(t *testing.T, svc *cubelet.Service, id, path string) string {
	t.Helper()
	sb, err := svc.Get(context.Background(), id)
	if err != nil || sb.Network == nil || sb.Network.HostIP == "" {
		t.Fatalf("sandbox %s has no slot: %+v, %v", id, sb, err)
	}
	return fmt.Sprintf("http://%s:%d%s", sb.Network.HostIP, agentproto.Port, path)
}

// setMemory stores env vars in the agent's memory only (POST /init): a
// cold-booted copy of the sandbox would not have them.
func setMemory(t *testing.T, svc *cubelet.Service, id string, vars map[string]string) {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"envVars": vars})
	c := agentClient()
	defer c.CloseIdleConnections()
	resp, err := c.Post(agentURL(t, svc, id, "/init"), "application/json", bytes.NewReader(body))
	if err != nil || resp.StatusCode/100 != 2 {
		t.Fatalf("init %s: %v %v", id, resp, err)
	}
	resp.Body.Close()
}

func memory(t *testing.T, svc *cubelet.Service, id string) map[string]string {
	t.Helper()
	c := agentClient()
	defer c.CloseIdleConnections()
	resp, err := c.Get(agentURL(t, svc, id, "/envs"))
	if err != nil {
		t.Fatalf("envs of %s: %v", id, err)
	}
	defer resp.Body.Close()
	var env map[string]string
	if err := json.NewDecoder(resp.Body).Decode(&env); err != nil {
		t.Fatalf("envs of %s: %v", id, err)
	}
	return env
}

// wantMemory checks the agent's /init variables: every key of want with
// its value, "" meaning the key must be absent.
func wantMemory(t *testing.T, svc *cubelet.Service, id string, want map[string]string) {
	t.Helper()
	got := memory(t, svc, id)
	for k, v := range want {
		if got[k] != v {
			t.Fatalf("%s holds %v in memory, want %s=%q", id, got, k, v)
		}
	}
}

// agentClient is a client of its own whose idle connections the caller
// closes: the host side must close first, so that no TCP connection is
// left open (or in TIME_WAIT) inside gVisor when it is checkpointed.
func agentClient() *http.Client {
	return &http.Client{Transport: &http.Transport{Proxy: nil}, Timeout: 10 * time.Second}
}

func requireRunsc(t *testing.T) {
	t.Helper()
	testenv.RequireBinary(t, "runsc", "runsc")
}

// TestGvisorSandboxes runs gVisor sandboxes through cubelet in network
// slots: create, pause (memory resident) and resume, disk snapshots, cold
// clones and rollback, faults that leave nothing, and the refusal of a
// gVisor sandbox without a slot, with memory snapshots switched off.
func TestGvisorSandboxes(t *testing.T) {
	cubelettest.RequireRoot(t)
	requireRunsc(t)
	ctx := context.Background()

	t.Run("no slot", func(t *testing.T) {
		env := cubelettest.New(t, "")
		svc := env.Start(t)
		env.ImportBusybox(t, svc, "busybox")
		_, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox", Runtime: "gvisor"})
		if !errdefs.IsFailedPrecondition(err) {
			t.Fatalf("gvisor create without slots = %v, want FailedPrecondition", err)
		}
		env.AssertNoLeaks(t)
	})

	// Memory snapshots off: this test covers the disk-only path
	// (gvisor_memory_test.go the memory one).
	env := cubelettest.New(t, "[gvisor]\ncheckpoint = false\n")
	env.StartNetworkAgent(t, nettest.Options{PoolSize: 2})
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	info, err := svc.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(fmt.Sprintf("%+v", info), "gvisor") {
		t.Fatalf("node info does not list gvisor: %+v", info)
	}

	a := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "gv-a", Runtime: "gvisor"})
	defer func() {
		for _, sb := range mustList(t, svc) {
			if _, err := svc.Delete(ctx, sb.ID); err != nil {
				t.Error(err)
			}
		}
		for _, sn := range listSnaps(t, svc, "") {
			_ = svc.DeleteSnapshot(ctx, sn)
		}
		assertSnapshotFiles(t, env, svc)
		env.AssertNoLeaks(t)
	}()
	if a.Runtime != "gvisor" || a.Container == nil {
		t.Fatalf("sandbox %+v", a)
	}
	orig := map[string]string{"SECRET": fmt.Sprint(time.Now().UnixNano())}
	setMemory(t, svc, a.ID, orig)

	t.Run("pause keeps memory", func(t *testing.T) {
		if _, err := svc.Pause(ctx, a.ID); err != nil {
			t.Fatal(err)
		}
		mustState(t, svc, a.ID, lifecycle.Paused)
		if _, err := svc.Resume(ctx, a.ID); err != nil {
			t.Fatal(err)
		}
		mustState(t, svc, a.ID, lifecycle.Running)
		wantMemory(t, svc, a.ID, orig)
	})

	sn := mustSnapshot(t, svc, cubelet.SnapshotRequest{SandboxID: a.ID, SnapshotID: "gv-snap"})
	if sn.HasMemory || sn.Runtime != "gvisor" {
		t.Fatalf("snapshot %+v: want disk-only of gvisor", sn)
	}
	mustState(t, svc, a.ID, lifecycle.Running)
	wantMemory(t, svc, a.ID, orig)

	t.Run("clone cold-boots", func(t *testing.T) {
		res, err := svc.Clone(ctx, cubelet.CloneRequest{SnapshotID: sn.ID, Count: 2})
		if err != nil {
			t.Fatalf("clone: %v", err)
		}
		for _, c := range res.Sandboxes {
			mustState(t, svc, c.ID, lifecycle.Running)
			if c.Runtime != "gvisor" {
				t.Fatalf("clone runtime %q", c.Runtime)
			}
			wantMemory(t, svc, c.ID, map[string]string{"SECRET": ""})
			if _, err := svc.Delete(ctx, c.ID); err != nil {
				t.Fatal(err)
			}
		}
	})

	t.Run("rollback", func(t *testing.T) {
		if _, err := svc.Rollback(ctx, cubelet.RollbackRequest{SandboxID: a.ID, SnapshotID: sn.ID}); err != nil {
			t.Fatalf("rollback: %v", err)
		}
		mustState(t, svc, a.ID, lifecycle.Running)
		wantMemory(t, svc, a.ID, map[string]string{"SECRET": ""})
	})

	t.Run("faults", func(t *testing.T) {
		for _, p := range points(svc, cubelet.FlowSnapshot) {
			inject(t, p, "1*error")
			if _, err := svc.Snapshot(ctx, cubelet.SnapshotRequest{SandboxID: a.ID, SnapshotID: "gv-never"}); !errors.Is(err, failpoint.ErrInjected) {
				t.Fatalf("%s: want injected error, got %v", p, err)
			}
			failpoint.Disable(p)
			mustState(t, svc, a.ID, lifecycle.Running)
		}
		for _, p := range []string{"clone/container/after", "clone/agent"} {
			inject(t, p, "1*error")
			if _, err := svc.Clone(ctx, cubelet.CloneRequest{SnapshotID: sn.ID, Count: 2}); !errors.Is(err, failpoint.ErrInjected) {
				t.Fatalf("%s: want injected error, got %v", p, err)
			}
			failpoint.Disable(p)
			if n := len(mustList(t, svc)); n != 1 {
				t.Fatalf("%s: %d sandboxes after a failed clone", p, n)
			}
		}
		inject(t, "rollback/container/after", "1*error")
		if _, err := svc.Rollback(ctx, cubelet.RollbackRequest{SandboxID: a.ID, SnapshotID: sn.ID}); !errors.Is(err, failpoint.ErrInjected) {
			t.Fatalf("rollback: want injected error, got %v", err)
		}
		failpoint.Disable("rollback/container/after")
		mustState(t, svc, a.ID, lifecycle.Running)
		if ids := listSnaps(t, svc, ""); len(ids) != 1 {
			t.Fatalf("snapshots after failed verbs: %v", ids)
		}
	})
}

func mustList(t *testing.T, svc *cubelet.Service) []*sandbox.Record {
	t.Helper()
	sbs, err := svc.List(context.Background(), cubelet.ListFilter{})
	if err != nil {
		t.Fatal(err)
	}
	return sbs
}
