package cli_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/cli"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/cubeletapi"
)

func TestSnapshotCLI(t *testing.T) {
	env := cubelettest.New(t, "")
	sock := filepath.Join(env.Dir, "cli.sock")
	env.Config.API.Socket = sock
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
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
	must := func(args ...string) string {
		t.Helper()
		out, errOut, code := run(t, sock, args...)
		if code != 0 {
			t.Fatalf("%v: exit %d\n%s%s", args, code, out, errOut)
		}
		return out
	}

	must("sandbox", "create", "-t", "busybox", "--id", "snap-src")
	out := must("snapshot", "create", "snap-src", "--id", "s1", "--name", "first", "-l", "k=v", "--timings")
	if !strings.Contains(out, "s1") || !strings.Contains(out, "first") || !strings.Contains(out, "ACTION") {
		t.Fatalf("snapshot create:\n%s", out)
	}
	out = must("snapshot", "ls", "--sandbox", "snap-src")
	if lines := strings.Split(strings.TrimSpace(out), "\n"); len(lines) != 2 || !strings.HasPrefix(lines[0], "ID") || !strings.Contains(lines[1], "k=v") {
		t.Fatalf("snapshot ls:\n%s", out)
	}
	var list struct {
		Snapshots []struct{ ID, SandboxID string }
	}
	if err := json.Unmarshal([]byte(must("snapshot", "ls", "-o", "json", "-l", "k=v")), &list); err != nil || len(list.Snapshots) != 1 || list.Snapshots[0].SandboxID != "snap-src" {
		t.Fatalf("snapshot ls json: %v %+v", err, list)
	}
	if out = must("snapshot", "inspect", "s1"); !strings.Contains(out, "disk only") {
		t.Fatalf("snapshot inspect:\n%s", out)
	}
	out = must("sandbox", "clone", "--count", "2", "--id", "cl-a,cl-b", "-l", "clone=1", "s1")
	if !strings.Contains(out, "cl-a") || !strings.Contains(out, "cl-b") || !strings.Contains(out, "running") {
		t.Fatalf("sandbox clone:\n%s", out)
	}
	var rb struct {
		Sandbox struct{ ID, SourceSnapshotID, State string }
	}
	if err := json.Unmarshal([]byte(must("sandbox", "rollback", "snap-src", "s1", "-o", "json")), &rb); err != nil ||
		rb.Sandbox.SourceSnapshotID != "s1" || rb.Sandbox.State != "SANDBOX_STATE_RUNNING" {
		t.Fatalf("sandbox rollback json: %v %+v", err, rb)
	}
	for _, c := range []struct {
		args []string
		code int
	}{
		{[]string{"snapshot", "inspect", "nope"}, cli.ExitNotFound},
		{[]string{"snapshot", "create", "snap-src", "--id", "s1"}, cli.ExitAlreadyExists},
		{[]string{"sandbox", "clone", "--count", "0", "s1"}, cli.ExitUsage},
		{[]string{"sandbox", "clone", "s1", "extra"}, cli.ExitUsage},
		{[]string{"sandbox", "rollback", "snap-src"}, cli.ExitUsage},
		{[]string{"sandbox", "create", "-t", "busybox", "--mount", "/srv"}, cli.ExitUsage},
		{[]string{"sandbox", "create", "-t", "busybox", "--mount", "/srv:/srv:ro"}, cli.ExitUsage}, // no allow-list
		{[]string{"template", "rm", "busybox"}, cli.ExitFailedPrecondition},
		{[]string{"snapshot", "rm"}, cli.ExitUsage},
	} {
		if _, errOut, code := run(t, sock, c.args...); code != c.code {
			t.Errorf("%v: exit %d, want %d (%s)", c.args, code, c.code, errOut)
		}
	}
	must("sandbox", "rm", "snap-src", "cl-a", "cl-b")
	if out = must("snapshot", "rm", "s1"); strings.TrimSpace(out) != "s1" {
		t.Fatalf("snapshot rm: %s", out)
	}
	must("template", "rm", "busybox")
	env.AssertNoLeaks(t)
}
