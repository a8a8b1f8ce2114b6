package integration

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/agent/agenttest"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/network/nettest"
)

// TestGvisorSnapshotCrashWake kills cubelet (SIGKILL) right after a
// gVisor snapshot quiesced the sandbox's agent, a running and a paused
// sandbox in turn. The restarted cubelet settles the interrupted snapshot
// and wakes the agent: the sandbox is back in its state and its agent
// answers at its slot address (after a resume, for the paused one). A
// quiesced agent left asleep refused every connection for good.
func TestGvisorSnapshotCrashWake(t *testing.T) {
	cubelettest.RequireRoot(t)
	requireRunsc(t)
	ctx := context.Background()
	env := cubelettest.New(t, "")
	n := env.StartNetworkAgent(t, nettest.Options{PoolSize: 2})
	cfgPath := env.WriteConfig(t, fmt.Sprintf("[network]\nagent_socket = %q\n", n.Socket))

	d := startDaemon(t, env, cfgPath, "")
	defer func() {
		// A failed run deletes its sandboxes through a fresh cubelet.
		if t.Failed() {
			d.kill()
			d = startDaemon(t, env, cfgPath, "")
			for _, id := range []string{"gc-false", "gc-true"} {
				_, _ = d.client.DeleteSandbox(ctx, &pb.DeleteSandboxRequest{SandboxId: id})
			}
			d.kill()
		}
	}()
	stream, err := d.client.ImportTemplate(ctx, &pb.ImportTemplateRequest{TemplateId: "busybox", Source: env.Image})
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := stream.Recv(); err != nil {
			if !strings.Contains(err.Error(), "EOF") {
				t.Fatalf("import: %v", err)
			}
			break
		}
	}
	health := func(c pb.CubeletServiceClient, id string) error {
		got, err := c.GetSandbox(ctx, &pb.GetSandboxRequest{SandboxId: id})
		if err != nil {
			return err
		}
		hc := &http.Client{Transport: &http.Transport{Proxy: nil}}
		defer hc.CloseIdleConnections()
		return agenttest.WaitHealthy(ctx, hc, fmt.Sprintf("http://%s:%d", got.Sandbox.Network.GetHostIp(), agentproto.Port), 30*time.Second)
	}
	for _, paused := range []bool{false, true} {
		id := fmt.Sprintf("gc-%v", paused)
		if _, err := d.client.CreateSandbox(ctx, &pb.CreateSandboxRequest{SandboxId: id, TemplateId: "busybox", Runtime: "gvisor"}); err != nil {
			t.Fatalf("create %s: %v", id, err)
		}
		want := pb.SandboxState_SANDBOX_STATE_RUNNING
		if paused {
			if _, err := d.client.PauseSandbox(ctx, &pb.PauseSandboxRequest{SandboxId: id}); err != nil {
				t.Fatal(err)
			}
			want = pb.SandboxState_SANDBOX_STATE_PAUSED
		}
		d.kill()
		d = startDaemon(t, env, cfgPath, "snapshot/quiesce/after=kill")
		if _, err := d.client.SnapshotSandbox(ctx, &pb.SnapshotSandboxRequest{SandboxId: id, SnapshotId: id + "-half"}); err == nil {
			t.Fatalf("%s: the snapshot survived its kill point", id)
		}
		d.kill()
		d = startDaemon(t, env, cfgPath, "")
		got, err := d.client.GetSandbox(ctx, &pb.GetSandboxRequest{SandboxId: id})
		if err != nil || got.Sandbox.State != want {
			t.Fatalf("%s after the restart: %v %v, want %v", id, got, err, want)
		}
		if paused {
			if _, err := d.client.ResumeSandbox(ctx, &pb.ResumeSandboxRequest{SandboxId: id}); err != nil {
				t.Fatal(err)
			}
		}
		if err := health(d.client, id); err != nil {
			t.Fatalf("%s: agent after a crash mid-snapshot: %v", id, err)
		}
		t.Logf("%s (paused %v): agent answers after a crash right after the snapshot's quiesce", id, paused)
		if _, err := d.client.DeleteSandbox(ctx, &pb.DeleteSandboxRequest{SandboxId: id}); err != nil {
			t.Fatal(err)
		}
	}
	list, err := d.client.ListSnapshots(ctx, &pb.ListSnapshotsRequest{})
	if err != nil || len(list.Snapshots) != 0 {
		t.Fatalf("half-taken snapshots left: %v %v", list, err)
	}
	d.kill()
	env.AssertNoLeaks(t)
}

// TestGvisorSnapshotCrashRestore kills cubelet (SIGKILL) right after a
// gVisor snapshot's checkpoint stopped the sandbox, before the disk copy
// and the restore in place; a running and a paused sandbox in turn. The
// image is complete on disk, so the restarted cubelet restores the sandbox
// from it: same ID, in its state, a process's in-memory value intact,
// the agent answering, the half-taken snapshot gone. Before, reconcile
// saw a stopped runtime and marked it failed ("died while cubelet was
// down").
func TestGvisorSnapshotCrashRestore(t *testing.T) {
	cubelettest.RequireRoot(t)
	requireRunsc(t)
	ctx := context.Background()
	env := cubelettest.New(t, "")
	n := env.StartNetworkAgent(t, nettest.Options{PoolSize: 2})
	cfgPath := env.WriteConfig(t, fmt.Sprintf("[network]\nagent_socket = %q\n", n.Socket))

	d := startDaemon(t, env, cfgPath, "")
	defer func() {
		if t.Failed() {
			d.kill()
			d = startDaemon(t, env, cfgPath, "")
			list, _ := d.client.ListSandboxes(ctx, &pb.ListSandboxesRequest{})
			for _, sb := range list.GetSandboxes() {
				_, _ = d.client.DeleteSandbox(ctx, &pb.DeleteSandboxRequest{SandboxId: sb.Id})
			}
			d.kill()
		}
	}()
	stream, err := d.client.ImportTemplate(ctx, &pb.ImportTemplateRequest{TemplateId: "busybox", Source: env.Image})
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := stream.Recv(); err != nil {
			if !strings.Contains(err.Error(), "EOF") {
				t.Fatalf("import: %v", err)
			}
			break
		}
	}
	url := func(id string) string {
		got, err := d.client.GetSandbox(ctx, &pb.GetSandboxRequest{SandboxId: id})
		if err != nil {
			t.Fatal(err)
		}
		return fmt.Sprintf("http://%s:%d", got.Sandbox.Network.GetHostIp(), agentproto.Port)
	}
	sh := func(id, script string) string {
		hc := agentClient()
		defer hc.CloseIdleConnections()
		if err := agenttest.WaitHealthy(ctx, hc, url(id), 30*time.Second); err != nil {
			t.Fatalf("%s: agent: %v", id, err)
		}
		return strings.TrimSpace(agenttest.Shell(ctx, t, hc, url(id), script))
	}
	for _, c := range []struct {
		paused bool
		point  string
	}{
		{false, "snapshot/memory/after"},
		{true, "snapshot/memory/after"},
		// Inside the restore in place, after the checkpointed sandbox
		// was retired (killed, its runsc state saying stopped), before
		// the restored copy starts in the other runsc slot.
		{false, "gvisor/restore/stopped"}, // gvisor.FailpointRestoreStopped
		// The restored copy runs, the background delete of the retired
		// slot has not started: the restart reaps it (the leak check at
		// the end finds no runsc state, process or cgroup left).
		{false, "gvisor/reap"}, // gvisor.FailpointReap
	} {
		paused := c.paused
		id := fmt.Sprintf("gr-%v-%d", paused, len(c.point))
		if _, err := d.client.CreateSandbox(ctx, &pb.CreateSandboxRequest{SandboxId: id, TemplateId: "busybox", Runtime: "gvisor"}); err != nil {
			t.Fatalf("create %s: %v", id, err)
		}
		value := fmt.Sprintf("mem-%d", time.Now().UnixNano())
		sh(id, fmt.Sprintf(`v=%s; (while :; do echo $v > /tmp/v; sleep 0.1; done) </dev/null >/dev/null 2>&1 &`, value))
		want := pb.SandboxState_SANDBOX_STATE_RUNNING
		if paused {
			if _, err := d.client.PauseSandbox(ctx, &pb.PauseSandboxRequest{SandboxId: id}); err != nil {
				t.Fatal(err)
			}
			want = pb.SandboxState_SANDBOX_STATE_PAUSED
		}
		d.kill()
		d = startDaemon(t, env, cfgPath, c.point+"=kill")
		if _, err := d.client.SnapshotSandbox(ctx, &pb.SnapshotSandboxRequest{SandboxId: id, SnapshotId: id + "-half"}); err == nil {
			t.Fatalf("%s: the snapshot survived its kill point", id)
		}
		d.kill()
		d = startDaemon(t, env, cfgPath, "")
		got, err := d.client.GetSandbox(ctx, &pb.GetSandboxRequest{SandboxId: id})
		if err != nil || got.Sandbox.State != want {
			t.Fatalf("%s after the restart: %v %v, want %v", id, got, err, want)
		}
		// One runsc state is left for the sandbox, whichever slot it
		// runs in: the restart reaped a retired one.
		if states, _ := filepath.Glob(filepath.Join(env.Config.Gvisor.Root, id+"*.state")); len(states) != 1 {
			t.Fatalf("%s after the restart: runsc states %v, want the running sandbox's only", id, states)
		}
		if paused {
			if _, err := d.client.ResumeSandbox(ctx, &pb.ResumeSandboxRequest{SandboxId: id}); err != nil {
				t.Fatal(err)
			}
		}
		if v := sh(id, `rm -f /tmp/v; for i in $(seq 50); do x=$(cat /tmp/v 2>/dev/null); [ -n "$x" ] && break; sleep 0.1; done; echo $x`); v != value {
			t.Fatalf("%s: in-memory value %q after the restore, want %q", id, v, value)
		}
		t.Logf("%s (paused %v, killed at %s): restored from the interrupted snapshot's image, memory intact", id, paused, c.point)
		if _, err := d.client.DeleteSandbox(ctx, &pb.DeleteSandboxRequest{SandboxId: id}); err != nil {
			t.Fatal(err)
		}
	}
	// A pause to disk cut short between its checkpoint and the record:
	// the restarted cubelet finishes the pause (the sandbox is paused to
	// disk, its image complete) and a resume brings the memory back.
	id := "gr-disk"
	if _, err := d.client.CreateSandbox(ctx, &pb.CreateSandboxRequest{SandboxId: id, TemplateId: "busybox", Runtime: "gvisor"}); err != nil {
		t.Fatalf("create %s: %v", id, err)
	}
	value := fmt.Sprintf("mem-%d", time.Now().UnixNano())
	sh(id, fmt.Sprintf(`v=%s; (while :; do echo $v > /tmp/v; sleep 0.1; done) </dev/null >/dev/null 2>&1 &`, value))
	d.kill()
	d = startDaemon(t, env, cfgPath, "pause_disk/checkpoint/written=kill")
	if _, err := d.client.PauseSandbox(ctx, &pb.PauseSandboxRequest{SandboxId: id, Mode: pb.PauseMode_PAUSE_MODE_DISK}); err == nil {
		t.Fatalf("%s: the pause to disk survived its kill point", id)
	}
	d.kill()
	d = startDaemon(t, env, cfgPath, "")
	got, err := d.client.GetSandbox(ctx, &pb.GetSandboxRequest{SandboxId: id})
	if err != nil || got.Sandbox.State != pb.SandboxState_SANDBOX_STATE_PAUSED {
		if b, rerr := os.ReadFile(d.log); rerr == nil {
			t.Logf("cubelet log:\n%s", b)
		}
		t.Fatalf("%s after the restart: %v %v, want paused (to disk)", id, got, err)
	}
	if _, err := d.client.ResumeSandbox(ctx, &pb.ResumeSandboxRequest{SandboxId: id}); err != nil {
		t.Fatal(err)
	}
	if v := sh(id, `rm -f /tmp/v; for i in $(seq 50); do x=$(cat /tmp/v 2>/dev/null); [ -n "$x" ] && break; sleep 0.1; done; echo $x`); v != value {
		t.Fatalf("%s: in-memory value %q after the resume, want %q", id, v, value)
	}
	t.Logf("%s: pause to disk finished by the restart, memory intact after resume", id)
	if _, err := d.client.DeleteSandbox(ctx, &pb.DeleteSandboxRequest{SandboxId: id}); err != nil {
		t.Fatal(err)
	}
	list, err := d.client.ListSnapshots(ctx, &pb.ListSnapshotsRequest{})
	if err != nil || len(list.Snapshots) != 0 {
		t.Fatalf("half-taken snapshots left: %v %v", list, err)
	}
	d.kill()
	env.AssertNoLeaks(t)
}
