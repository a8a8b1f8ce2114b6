package cli_test

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/cli"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/cubeletapi"
)

func run(t *testing.T, sock string, args ...string) (string, string, int) {
	t.Helper()
	var out, errb bytes.Buffer
	code := cli.Main(append([]string{"--addr", sock}, args...), &out, &errb)
	return out.String(), errb.String(), code
}

func TestCLI(t *testing.T) {
	env := cubelettest.New(t, "")
	sock := filepath.Join(env.Dir, "cli.sock")
	env.Config.API.Socket = sock
	svc := env.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = cubeletapi.Serve(ctx, svc, slog.Default()); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	for i := 0; ; i++ {
		if _, _, code := run(t, sock, "node", "info"); code == 0 {
			break
		} else if i > 100 {
			t.Fatal("cubelet API never came up")
		}
		time.Sleep(20 * time.Millisecond)
	}

	out, errOut, code := run(t, sock, "template", "import", "busybox", env.Image)
	if code != 0 || !strings.Contains(out, "busybox") || !strings.Contains(errOut, "done") {
		t.Fatalf("import: %d\n%s\n%s", code, out, errOut)
	}
	out, _, code = run(t, sock, "sandbox", "create", "-t", "busybox", "--id", "cli-one", "-l", "team=x", "--memory", "64", "--timings")
	if code != 0 || !strings.Contains(out, "cli-one") || !strings.Contains(out, "running") || !strings.Contains(out, "ACTION") {
		t.Fatalf("create: %d\n%s", code, out)
	}
	out, _, _ = run(t, sock, "sandbox", "ls")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 2 || !strings.HasPrefix(lines[0], "ID") || !strings.Contains(lines[1], "team=x") {
		t.Fatalf("ls table:\n%s", out)
	}
	out, _, code = run(t, sock, "sandbox", "ls", "-o", "json", "--state", "running", "-l", "team=x")
	var list struct {
		Sandboxes []struct{ ID, State string }
	}
	if err := json.Unmarshal([]byte(out), &list); code != 0 || err != nil || len(list.Sandboxes) != 1 || list.Sandboxes[0].State != "SANDBOX_STATE_RUNNING" {
		t.Fatalf("ls json: %d %v\n%s", code, err, out)
	}
	// runc cannot write a memory image: refused, nothing changes.
	if _, errOut, code = run(t, sock, "sandbox", "pause", "--to-disk", "cli-one"); code != cli.ExitFailedPrecondition || !strings.Contains(errOut, "cannot checkpoint") {
		t.Fatalf("pause --to-disk on runc: %d %s", code, errOut)
	}
	if _, _, code = run(t, sock, "sandbox", "pause", "cli-one"); code != 0 {
		t.Fatalf("pause: %d", code)
	}
	if out, _, _ = run(t, sock, "sandbox", "inspect", "cli-one"); !regexp.MustCompile(`Pause mode\s+memory`).MatchString(out) {
		t.Fatalf("inspect of a paused sandbox shows no pause mode:\n%s", out)
	}
	if _, errOut, code = run(t, sock, "sandbox", "pause", "cli-one"); code != cli.ExitFailedPrecondition || !strings.Contains(errOut, "paused") {
		t.Fatalf("second pause: %d %s", code, errOut)
	}
	out, _, _ = run(t, sock, "sandbox", "inspect", "cli-one", "-o", "json")
	if !strings.Contains(out, `"SANDBOX_STATE_PAUSED"`) || !regexp.MustCompile(`"pauseMode":\s*"memory"`).MatchString(out) {
		t.Fatalf("inspect: %s", out)
	}
	if _, _, code = run(t, sock, "sandbox", "resume", "cli-one"); code != 0 {
		t.Fatalf("resume: %d", code)
	}
	if _, _, code = run(t, sock, "sandbox", "inspect", "nope"); code != cli.ExitNotFound {
		t.Fatalf("inspect missing: %d", code)
	}
	if _, _, code = run(t, sock, "sandbox", "create", "-t", "busybox", "--id", "cli-one"); code != cli.ExitAlreadyExists {
		t.Fatalf("duplicate: %d", code)
	}
	if _, _, code = run(t, sock, "sandbox", "create", "-t", "busybox", "--memory", "-3"); code != cli.ExitUsage {
		t.Fatalf("negative memory: %d", code)
	}
	if _, _, code = run(t, sock, "sandbox", "create"); code != cli.ExitUsage {
		t.Fatalf("missing template flag: %d", code)
	}
	if _, _, code = run(t, sock, "sandbox", "ls", "-o", "yaml"); code != cli.ExitUsage {
		t.Fatalf("bad output format: %d", code)
	}
	out, _, code = run(t, sock, "flow", "set-limit", "create", "3")
	if code != 0 || !strings.Contains(out, "disk+net > rootfs > container > agent") {
		t.Fatalf("flow set-limit: %d\n%s", code, out)
	}
	if _, _, code = run(t, sock, "template", "rm", "busybox"); code != cli.ExitFailedPrecondition {
		t.Fatalf("rm template in use: %d", code)
	}
	if out, _, code = run(t, sock, "sandbox", "rm", "cli-one"); code != 0 || strings.TrimSpace(out) != "cli-one" {
		t.Fatalf("rm: %d %s", code, out)
	}
	if _, _, code = run(t, sock, "template", "rm", "busybox"); code != 0 {
		t.Fatalf("rm template: %d", code)
	}
	if _, _, code = run(t, "/nonexistent.sock", "--timeout", "1s", "node", "info"); code != cli.ExitUnavailable {
		t.Fatalf("unreachable cubelet: %d", code)
	}
	env.AssertNoLeaks(t)
}
