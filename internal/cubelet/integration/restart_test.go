package integration

import (
	"context"

	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/cubelet/agentclient"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/cubeletclient"
	"github.com/cubesandbox/cube/internal/leakcheck"
)

// daemon is a cubelet running as a real process, so it can be SIGKILLed.
type daemon struct {
	cmd    *exec.Cmd
	client pb.CubeletServiceClient
	close  func()
	log    string
}

func startDaemon(t *testing.T, env *cubelettest.Env, cfgPath, failpoints string) *daemon {
	t.Helper()
	bin := filepath.Join(cubelettest.Binaries(t), "cubelet")
	logPath := filepath.Join(env.Dir, "cubelet.log")
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "--config", cfgPath)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = append(os.Environ(), "CUBE_FAILPOINTS="+failpoints)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	logf.Close()
	conn, err := cubeletclient.Dial(env.Config.API.Socket)
	if err != nil {
		t.Fatal(err)
	}
	d := &daemon{cmd: cmd, client: cubeletclient.New(conn), log: logPath}
	d.close = func() { conn.Close() }
	deadline := time.Now().Add(60 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := d.client.Health(ctx, &pb.HealthRequest{})
		cancel()
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			d.kill()
			t.Fatalf("cubelet did not come up: %v\n%s", err, tail(logPath))
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Cleanup(d.kill)
	return d
}

// kill SIGKILLs the daemon (if still alive) and reaps it.
func (d *daemon) kill() {
	if d.cmd.ProcessState == nil {
		_ = d.cmd.Process.Signal(syscall.SIGKILL)
		_ = d.cmd.Wait()
	}
	d.close()
}

// waitDead waits for a daemon that a failpoint killed.
func (d *daemon) waitDead(t *testing.T) {
	t.Helper()
	done := make(chan struct{})
	go func() { _ = d.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatalf("cubelet was not killed by its failpoint\n%s", tail(d.log))
	}
	d.close()
}

func tail(path string) string {
	b, _ := os.ReadFile(path)
	s := string(b)
	if len(s) > 4000 {
		s = s[len(s)-4000:]
	}
	return s
}

// TestKillAndRestart kills cubelet with SIGKILL at every action boundary of
// create, pause, resume and destroy, restarts it, and checks that every
// sandbox ends Running, Paused or cleanly gone, that sandboxes created
// before keep running and stay manageable, and that nothing leaks.
func TestKillAndRestart(t *testing.T) {
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
			if err.Error() != "EOF" && !strings.Contains(err.Error(), "EOF") {
				t.Fatalf("import: %v", err)
			}
			break
		}
	}
	mk := func(c pb.CubeletServiceClient, id string) {
		t.Helper()
		if _, err := c.CreateSandbox(ctx, &pb.CreateSandboxRequest{SandboxId: id, TemplateId: "busybox"}); err != nil {
			t.Fatalf("create %s: %v", id, err)
		}
	}
	mk(d.client, "keep-running")
	mk(d.client, "keep-paused")
	if _, err := d.client.PauseSandbox(ctx, &pb.PauseSandboxRequest{SandboxId: "keep-paused"}); err != nil {
		t.Fatal(err)
	}
	d.kill()

	type scenario struct {
		point string
		// prepare runs on a healthy daemon and returns the sandbox the
		// killed operation works on.
		prepare func(c pb.CubeletServiceClient) string
		op      func(c pb.CubeletServiceClient, id string) error
	}
	var scenarios []scenario
	for _, a := range []string{"disk", "rootfs", "container", "agent"} {
		for _, sfx := range []string{"", "/after"} {
			scenarios = append(scenarios, scenario{
				point:   "create/" + a + sfx,
				prepare: func(pb.CubeletServiceClient) string { return "victim" },
				op: func(c pb.CubeletServiceClient, id string) error {
					_, err := c.CreateSandbox(ctx, &pb.CreateSandboxRequest{SandboxId: id, TemplateId: "busybox"})
					return err
				},
			})
		}
	}
	for _, p := range []string{"pause/container", "pause/container/after"} {
		scenarios = append(scenarios, scenario{
			point:   p,
			prepare: func(c pb.CubeletServiceClient) string { mk(c, "victim"); return "victim" },
			op: func(c pb.CubeletServiceClient, id string) error {
				_, err := c.PauseSandbox(ctx, &pb.PauseSandboxRequest{SandboxId: id})
				return err
			},
		})
	}
	for _, p := range []string{"resume/container", "resume/container/after", "resume/agent/after"} {
		scenarios = append(scenarios, scenario{
			point: p,
			prepare: func(c pb.CubeletServiceClient) string {
				mk(c, "victim")
				if _, err := c.PauseSandbox(ctx, &pb.PauseSandboxRequest{SandboxId: "victim"}); err != nil {
					t.Fatal(err)
				}
				return "victim"
			},
			op: func(c pb.CubeletServiceClient, id string) error {
				_, err := c.ResumeSandbox(ctx, &pb.ResumeSandboxRequest{SandboxId: id})
				return err
			},
		})
	}
	for _, a := range []string{"container", "rootfs", "disk"} {
		for _, sfx := range []string{"", "/after"} {
			scenarios = append(scenarios, scenario{
				point:   "destroy/" + a + sfx,
				prepare: func(c pb.CubeletServiceClient) string { mk(c, "victim"); return "victim" },
				op: func(c pb.CubeletServiceClient, id string) error {
					_, err := c.DeleteSandbox(ctx, &pb.DeleteSandboxRequest{SandboxId: id})
					return err
				},
			})
		}
	}

	for _, sc := range scenarios {
		t.Run(strings.ReplaceAll(sc.point, "/", "_"), func(t *testing.T) {
			// Prepare on a clean daemon, then restart it armed to die.
			d := startDaemon(t, env, cfgPath, "")
			id := sc.prepare(d.client)
			d.kill()
			d = startDaemon(t, env, cfgPath, sc.point+"=kill")
			if err := sc.op(d.client, id); err == nil {
				t.Fatalf("operation succeeded; the failpoint %s never fired", sc.point)
			}
			d.waitDead(t)

			d = startDaemon(t, env, cfgPath, "")
			got, err := d.client.GetSandbox(ctx, &pb.GetSandboxRequest{SandboxId: id})
			switch {
			case status.Code(err) == codes.NotFound:
			case err != nil:
				t.Fatalf("get after restart: %v", err)
			default:
				st := got.Sandbox.State
				if st != pb.SandboxState_SANDBOX_STATE_RUNNING && st != pb.SandboxState_SANDBOX_STATE_PAUSED {
					t.Fatalf("after restart %s is %s (%s)", id, st, got.Sandbox.Error)
				}
				if _, err := d.client.DeleteSandbox(ctx, &pb.DeleteSandboxRequest{SandboxId: id}); err != nil {
					t.Fatalf("delete after restart: %v", err)
				}
			}
			// The bystanders kept their state through the crash.
			for id, want := range map[string]pb.SandboxState{
				"keep-running": pb.SandboxState_SANDBOX_STATE_RUNNING,
				"keep-paused":  pb.SandboxState_SANDBOX_STATE_PAUSED,
			} {
				got, err := d.client.GetSandbox(ctx, &pb.GetSandboxRequest{SandboxId: id})
				if err != nil || got.Sandbox.State != want {
					t.Fatalf("bystander %s: %v %v", id, got, err)
				}
			}
			d.kill()
			// Only the two bystanders may hold anything now.
			assertOnlyBystanders(t, env)
		})
	}

	// Still manageable after all those restarts.
	d = startDaemon(t, env, cfgPath, "")
	if _, err := d.client.ResumeSandbox(ctx, &pb.ResumeSandboxRequest{SandboxId: "keep-paused"}); err != nil {
		t.Fatalf("resume adopted sandbox: %v", err)
	}
	if _, err := d.client.PauseSandbox(ctx, &pb.PauseSandboxRequest{SandboxId: "keep-running"}); err != nil {
		t.Fatalf("pause adopted sandbox: %v", err)
	}
	for _, id := range []string{"keep-running", "keep-paused"} {
		if _, err := d.client.DeleteSandbox(ctx, &pb.DeleteSandboxRequest{SandboxId: id}); err != nil {
			t.Fatalf("delete %s: %v", id, err)
		}
	}
	d.kill()
	env.AssertNoLeaks(t)
}

// TestSandboxesOutliveCubelet kills cubelet with no operation in flight and
// checks the sandbox never noticed: same PID, agent answering throughout.
func TestSandboxesOutliveCubelet(t *testing.T) {
	env := cubelettest.New(t, "")
	cfgPath := env.WriteConfig(t, "")
	ctx := context.Background()
	d := startDaemon(t, env, cfgPath, "")
	stream, _ := d.client.ImportTemplate(ctx, &pb.ImportTemplateRequest{TemplateId: "busybox", Source: env.Image})
	for {
		if _, err := stream.Recv(); err != nil {
			break
		}
	}
	resp, err := d.client.CreateSandbox(ctx, &pb.CreateSandboxRequest{SandboxId: "survivor", TemplateId: "busybox"})
	if err != nil {
		t.Fatal(err)
	}
	pid := int(resp.Sandbox.Pid)
	d.kill()
	if err := waitAgent(pid); err != nil {
		t.Fatalf("agent died with cubelet: %v", err)
	}
	d = startDaemon(t, env, cfgPath, "")
	got, err := d.client.GetSandbox(ctx, &pb.GetSandboxRequest{SandboxId: "survivor"})
	if err != nil || got.Sandbox.Pid != int32(pid) || got.Sandbox.State != pb.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("after restart: %v %v", got, err)
	}
	if _, err := d.client.DeleteSandbox(ctx, &pb.DeleteSandboxRequest{SandboxId: "survivor"}); err != nil {
		t.Fatal(err)
	}
	d.kill()
	env.AssertNoLeaks(t)
}

func waitAgent(pid int) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return agentclient.WaitAgent(ctx, pid)
}

// assertOnlyBystanders runs the leak checker and ignores what the two
// long-lived sandboxes legitimately hold.
func assertOnlyBystanders(t *testing.T, env *cubelettest.Env) {
	t.Helper()
	leaks, err := leakcheck.Check(context.Background(), env.Scope())
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range leaks {
		s := l.String()
		if strings.Contains(s, "keep-running") || strings.Contains(s, "keep-paused") {
			continue
		}
		t.Errorf("leak: %s", s)
	}
}
