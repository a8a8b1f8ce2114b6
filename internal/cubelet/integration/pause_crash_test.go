package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/agentclient"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/store"
	"github.com/cubesandbox/cube/internal/testenv"
)

// TestPauseResumeAnsweredBeforeRecord: a memory pause or resume answers
// before its record is on disk. It SIGKILLs cubelet after the answer with
// the background record writer held (failpoint store/sandbox-flush=hang),
// checks that the record on disk still names the old state while the
// runtime (runc's view of the cgroup freezer) has the new one — the window
// is real — and that the restarted cubelet reports the runtime's state and
// the sandbox keeps working from there.
func TestPauseResumeAnsweredBeforeRecord(t *testing.T) {
	runc := testenv.RequireBinary(t, "runc", "runc")
	env := cubelettest.New(t, "")
	cfgPath := env.WriteConfig(t, "")
	ctx := context.Background()

	d := startDaemon(t, env, cfgPath, "")
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
	if _, err := d.client.CreateSandbox(ctx, &pb.CreateSandboxRequest{SandboxId: "victim", TemplateId: "busybox"}); err != nil {
		t.Fatal(err)
	}
	d.kill()

	// onDisk reads the sandbox's record from the state file of a dead
	// cubelet.
	onDisk := func() (lifecycle.State, string) {
		t.Helper()
		st, err := store.Open(env.Config.StorePath())
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		rec, err := st.GetSandbox("victim")
		if err != nil {
			t.Fatal(err)
		}
		return rec.State, rec.Container.ID
	}
	// runcStatus is what runc reports; runc reads it from the freezer.
	runcStatus := func(cid string) string {
		t.Helper()
		out, err := exec.Command(runc, "--root", env.Config.Runc.Root, "state", cid).Output()
		if err != nil {
			t.Fatalf("runc state %s: %v", cid, err)
		}
		var s struct {
			Status string `json:"status"`
		}
		if err := json.Unmarshal(out, &s); err != nil {
			t.Fatal(err)
		}
		return s.Status
	}

	for _, c := range []struct {
		verb       string
		op         func(pb.CubeletServiceClient) (*pb.Sandbox, error)
		before     lifecycle.State // the record the crash leaves on disk
		runc       string          // what the runtime says
		afterState pb.SandboxState // what the restarted cubelet reports
	}{
		{"pause", func(c pb.CubeletServiceClient) (*pb.Sandbox, error) {
			r, err := c.PauseSandbox(ctx, &pb.PauseSandboxRequest{SandboxId: "victim"})
			return r.GetSandbox(), err
		}, lifecycle.Running, "paused", pb.SandboxState_SANDBOX_STATE_PAUSED},
		{"resume", func(c pb.CubeletServiceClient) (*pb.Sandbox, error) {
			r, err := c.ResumeSandbox(ctx, &pb.ResumeSandboxRequest{SandboxId: "victim"})
			return r.GetSandbox(), err
		}, lifecycle.Paused, "running", pb.SandboxState_SANDBOX_STATE_RUNNING},
	} {
		t.Run(c.verb, func(t *testing.T) {
			d := startDaemon(t, env, cfgPath, "store/sandbox-flush=hang")
			sb, err := c.op(d.client)
			if err != nil {
				t.Fatalf("%s: %v", c.verb, err)
			}
			if sb.State != c.afterState {
				t.Fatalf("%s answered %s", c.verb, sb.State)
			}
			d.kill() // the record writer is still held: the crash is between answer and write

			state, cid := onDisk()
			if state != c.before {
				t.Fatalf("record on disk after the crash says %s, want %s (the write was not held back: the test proves nothing)", state, c.before)
			}
			if got := runcStatus(cid); got != c.runc {
				t.Fatalf("runc status %s, want %s", got, c.runc)
			}
			t.Logf("after %s and a crash: record on disk %s, runc %s", c.verb, state, c.runc)

			d = startDaemon(t, env, cfgPath, "")
			got, err := d.client.GetSandbox(ctx, &pb.GetSandboxRequest{SandboxId: "victim"})
			if err != nil {
				t.Fatal(err)
			}
			if got.Sandbox.State != c.afterState {
				t.Fatalf("restarted cubelet reports %s (%s), want %s as the runtime says", got.Sandbox.State, got.Sandbox.Error, c.afterState)
			}
			d.kill()
			if state, _ := onDisk(); state == c.before {
				t.Fatalf("reconcile left the record on disk at %s", state)
			}
			if c.afterState == pb.SandboxState_SANDBOX_STATE_RUNNING {
				wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
				defer cancel()
				if err := agentclient.WaitAgent(wctx, int(got.Sandbox.Pid)); err != nil {
					t.Fatalf("agent after restart: %v", err)
				}
			}
		})
	}

	d = startDaemon(t, env, cfgPath, "")
	if _, err := d.client.PauseSandbox(ctx, &pb.PauseSandboxRequest{SandboxId: "victim"}); err != nil {
		t.Fatalf("pause after the crashes: %v", err)
	}
	if _, err := d.client.ResumeSandbox(ctx, &pb.ResumeSandboxRequest{SandboxId: "victim"}); err != nil {
		t.Fatalf("resume after the crashes: %v", err)
	}
	if _, err := d.client.DeleteSandbox(ctx, &pb.DeleteSandboxRequest{SandboxId: "victim"}); err != nil {
		t.Fatal(err)
	}
	d.kill()
	env.AssertNoLeaks(t)
}

// TestResumeInitKilledWhileFrozen: a runc resume does not ask the agent
// again after the thaw (the thawed agent is the init that answered before
// the pause), so what it must still catch is an init that died while
// frozen: the resume fails, or the sandbox is Failed moments later (the
// runtime watch), never left Running. The control resumes the same way
// without the kill: Running, and the agent answers at once.
func TestResumeInitKilledWhileFrozen(t *testing.T) {
	env := cubelettest.New(t, "")
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()

	ctl := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "frozen-ctl", Runtime: "runc"})
	cleanupDelete(t, svc, ctl.ID)
	if _, err := svc.Pause(ctx, ctl.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := svc.Resume(ctx, ctl.ID); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	if err := agentclient.WaitAgent(wctx, ctl.Container.PID); err != nil {
		t.Fatalf("control: agent after resume: %v", err)
	}
	stays(t, svc, ctl.ID, lifecycle.Running, 500*time.Millisecond)

	// Several rounds: whether the resume finds the init already gone
	// (its leader exited, other threads still on their way out) or still
	// there depends on how far the kill got, and the first case is the
	// one where a re-freeze by the resume's undo would hold the exiting
	// threads forever (cgroup v1's freezer is not left by a SIGKILL).
	for i := range 4 {
		sb := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: fmt.Sprintf("frozen-kill-%d", i), Runtime: "runc"})
		cleanupDelete(t, svc, sb.ID)
		if _, err := svc.Pause(ctx, sb.ID); err != nil {
			t.Fatal(err)
		}
		if err := unix.Kill(sb.Container.PID, unix.SIGKILL); err != nil {
			t.Fatal(err)
		}
		_, rerr := svc.Resume(ctx, sb.ID)
		r := waitFailed(t, svc, sb.ID, 5*time.Second)
		t.Logf("resume after the init was killed while frozen: %v; then %s (%s)", rerr, r.State, r.Error)
	}
}
