package gvisor

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime/procstate"
)

// TestStateFileMatchesRunsc: the driver reads runsc's state file instead
// of running `runsc state`; in every state a sandbox goes through here
// (running, paused, its process killed behind runsc's back, stopped by a
// checkpoint, removed) both give the same status, PID and bundle. The
// control is `runsc state` itself, asked each time.
func TestStateFileMatchesRunsc(t *testing.T) {
	requireRunsc(t)
	d, parent := newTestDriver(t), cgroupParent(t)
	ctx := t.Context()
	same := func(step, id string) {
		t.Helper()
		got, err := d.readState(ctx, id, runscID(id))
		want, werr := d.rsc("none", "").State(ctx, runscID(id))
		if werr != nil {
			if got != nil || !errdefs.IsNotFound(err) {
				t.Fatalf("%s: runsc state fails (%v); the state file says %+v, %v, want not found", step, werr, got, err)
			}
			t.Logf("%s: both say gone", step)
			return
		}
		if err != nil {
			t.Fatalf("%s: state file: %v (runsc state: %+v)", step, err, want)
		}
		if got.Status != want.Status || got.Pid != want.Pid || got.Bundle != want.Bundle {
			t.Fatalf("%s: state file says %s pid %d bundle %s; runsc state says %s pid %d bundle %s",
				step, got.Status, got.Pid, got.Bundle, want.Status, want.Pid, want.Bundle)
		}
		t.Logf("%s: both say %s, pid %d", step, got.Status, got.Pid)
	}

	startCounter(t, d, parent, "st-a")
	same("running", "st-a")
	if err := d.Pause(ctx, "st-a"); err != nil {
		t.Fatal(err)
	}
	same("paused", "st-a")
	if err := d.Resume(ctx, "st-a"); err != nil {
		t.Fatal(err)
	}
	same("resumed", "st-a")
	c, err := d.readState(ctx, "st-a", runscID("st-a"))
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(c.Pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for syscall.Kill(c.Pid, 0) == nil && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	same("sandbox process killed", "st-a")

	// The dead sandbox's PID reused by another process (this test's):
	// the state file still says running with that PID. Only the cgroup
	// check stops it looking alive: the control is the same PID without
	// it.
	b, err := os.ReadFile(d.statePath(runscID("st-a")))
	if err != nil {
		t.Fatal(err)
	}
	var st map[string]json.RawMessage
	if err := json.Unmarshal(b, &st); err != nil {
		t.Fatal(err)
	}
	var sb map[string]json.RawMessage
	if err := json.Unmarshal(st["sandbox"], &sb); err != nil {
		t.Fatal(err)
	}
	sb["pid"] = json.RawMessage(strconv.Itoa(os.Getpid()))
	if st["sandbox"], err = json.Marshal(sb); err != nil {
		t.Fatal(err)
	}
	if b, err = json.Marshal(st); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(d.statePath(runscID("st-a")), b, 0o600); err != nil {
		t.Fatal(err)
	}
	same("its PID reused by another process", "st-a")
	if live, err := procstate.Alive(os.Getpid(), ""); !live || err != nil {
		t.Fatalf("control: without the cgroup check the reused PID is alive=%v (%v), want true", live, err)
	}
	if err := d.Stop(ctx, "st-a"); err != nil {
		t.Fatal(err)
	}
	same("stopped and removed", "st-a")

	startCounter(t, d, parent, "st-b")
	if err := d.Checkpoint(ctx, "st-b", filepath.Join(t.TempDir(), "img"), false); err != nil {
		t.Fatal(err)
	}
	same("checkpointed", "st-b")
	same("never existed", "st-none")
}
