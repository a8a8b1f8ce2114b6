package procs

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	pb "github.com/cubesandbox/cube/api/envd/process"
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

// TestPumpDrainsAfterDeadline: output a process wrote just before it
// exited is published even when the drain deadline fires before the read
// (the deadline can wake the reader before the poller reports the data,
// and Go's Read then returns without trying the descriptor). Here the
// deadline has passed before the first read, so a plain Read never looks.
func TestPumpDrainsAfterDeadline(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	want := "written just before exit\n"
	if _, err := w.WriteString(want); err != nil {
		t.Fatal(err)
	}
	w.Close()
	if err := r.SetReadDeadline(time.Now().Add(-time.Second)); err != nil {
		t.Fatal(err)
	}
	// Control: the deadline alone stops a plain Read from seeing the data.
	if n, err := r.Read(make([]byte, 64)); n != 0 || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("control: Read after the deadline = %d, %v; want 0 and a deadline error", n, err)
	}
	p := &Proc{subs: map[*Subscription]struct{}{}, closed: make(chan struct{})}
	sub, _ := p.Subscribe()
	p.pump(r, pipeChunk, func(b []byte) *pb.ProcessEvent_DataEvent {
		return &pb.ProcessEvent_DataEvent{Output: &pb.ProcessEvent_DataEvent_Stdout{Stdout: b}}
	})
	var got []byte
	for len(sub.C) > 0 {
		got = append(got, (<-sub.C).Data.GetStdout()...)
	}
	if string(got) != want {
		t.Fatalf("published %q, want %q", got, want)
	}
}
