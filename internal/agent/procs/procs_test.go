package procs

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/agent/identity"
	"github.com/cubesandbox/cube/internal/agent/initproc"
	"github.com/cubesandbox/cube/internal/errdefs"
)

func TestEndEvent(t *testing.T) {
	exit := func(code int) unix.WaitStatus { return unix.WaitStatus(code << 8) }
	cases := []struct {
		ws     unix.WaitStatus
		code   int32
		exited bool
		status string
		err    bool
	}{
		{exit(0), 0, true, "exit status 0", false},
		{exit(3), 3, true, "exit status 3", true},
		{unix.WaitStatus(unix.SIGKILL), -1, false, "signal: killed", true},
		{unix.WaitStatus(unix.SIGSEGV) | 0x80, -1, false, "signal: segmentation fault (core dumped)", true},
	}
	for _, c := range cases {
		e := endEvent(initproc.Exit{Status: c.ws})
		if e.GetExitCode() != c.code || e.GetExited() != c.exited || e.GetStatus() != c.status || (e.Error != nil) != c.err {
			t.Errorf("status %#x: got code=%d exited=%v status=%q error=%v", uint32(c.ws), e.GetExitCode(), e.GetExited(), e.GetStatus(), e.Error)
		}
		if c.err && e.GetError() != c.status {
			t.Errorf("error %q, want the status", e.GetError())
		}
	}
}

func TestBuildEnv(t *testing.T) {
	t.Setenv("PATH", "/agent/bin")
	u := &identity.User{Name: "user", Home: "/home/user"}
	env := buildEnv(u, map[string]string{"A": "init", "HOME": "/elsewhere"}, map[string]string{"A": "req", "B": "b"})
	want := []string{"PATH=/agent/bin", "HOME=/elsewhere", "USER=user", "LOGNAME=user", "A=req", "B=b"}
	if !slices.Equal(env, want) {
		t.Fatalf("env = %v, want %v", env, want)
	}
}

func TestLookPath(t *testing.T) {
	dir := t.TempDir()
	exe := filepath.Join(dir, "tool")
	if err := os.WriteFile(exe, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "data"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	env := []string{"PATH=/nonexistent:" + dir}
	if p, err := lookPath("tool", env); err != nil || p != exe {
		t.Errorf("lookPath(tool) = %q, %v", p, err)
	}
	if _, err := lookPath("data", env); !errdefs.IsInvalidArgument(err) {
		t.Errorf("non-executable found: %v", err)
	}
	if p, err := lookPath("./rel/x", env); err != nil || p != "./rel/x" {
		t.Errorf("a path is taken as is: %q %v", p, err)
	}
}
