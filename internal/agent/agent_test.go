package agent

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/agent/agenttest"
	"github.com/cubesandbox/cube/internal/agent/identity"
	"github.com/cubesandbox/cube/internal/agent/initproc"
	"github.com/cubesandbox/cube/internal/testenv"
)

// reaper is this test process's only waiter, as in cube-agent: every
// process the agents under test start goes through it.
var reaper = initproc.NewReaper(slog.New(slog.DiscardHandler))

func TestMain(m *testing.M) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = initproc.Supervise(ctx, initproc.Config{Reaper: reaper, Logger: slog.New(slog.DiscardHandler)})
	}()
	code := m.Run()
	cancel()
	<-done
	os.Exit(code)
}

// sandboxLike makes a directory tree shaped like the test template: users
// root and user (uid 1000) with their homes, and a root-only directory.
func sandboxLike(t *testing.T) (identity.DB, string, string) {
	t.Helper()
	// Not t.TempDir: uid 1000 must be able to traverse it.
	dir, err := os.MkdirTemp("", "agent-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	home := filepath.Join(dir, "home", "user")
	rootOnly := filepath.Join(dir, "root-only")
	for _, d := range []string{home, rootOnly} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chown(home, 1000, 1000); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(rootOnly, 0o700); err != nil {
		t.Fatal(err)
	}
	db := identity.DB{Passwd: filepath.Join(dir, "passwd"), Group: filepath.Join(dir, "group")}
	passwd := fmt.Sprintf("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:%s:/bin/sh\n", home)
	if err := os.WriteFile(db.Passwd, []byte(passwd), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(db.Group, []byte("root:x:0:\nuser:x:1000:\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return db, home, rootOnly
}

// TestConformance runs the envd conformance suite against an in-process
// agent on the host.
func TestConformance(t *testing.T) {
	testenv.RequireRoot(t, "acts as other users")
	db, home, rootOnly := sandboxLike(t)
	srv := New(Config{
		Starter: reaper,
		Users:   db,
		Env:     SandboxEnv([]string{"CUBE_CREATE_VAR=from config", "HOME=/not/the/user's", "PATH=/x"}),
		Logger:  slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})),
		SetClock: func(unix.Timespec) error {
			t.Error("the suite must never set the host's clock")
			return unix.EPERM
		},
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("serve: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Error("server did not stop")
		}
	})
	agenttest.Run(t, agenttest.Target{
		URL: "http://" + ln.Addr().String(), UserHome: home, RootOnly: rootOnly,
		Env: map[string]string{"CUBE_CREATE_VAR": "from config"},
	})
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(string(p))
	return len(p), nil
}
