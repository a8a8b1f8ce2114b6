package gvisor

import (
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/runtime"
)

// lostReplyRunsc writes a runsc wrapper whose checkpoint runs the real
// one and then reports what runsc 20221219 reports when the sandbox
// process exits before its reply reaches runsc (exit 128, "urpc method
// ... failed: EOF"), whatever the save did. Every other command is the
// real runsc's. The race itself is rare (a few checkpoints in a hundred
// on a loaded host: TestParallelCheckpoints), so this is how a test
// meets it every time.
func lostReplyRunsc(t *testing.T) string {
	t.Helper()
	runsc, err := exec.LookPath("runsc")
	if err != nil {
		t.Fatal(err)
	}
	w := filepath.Join(t.TempDir(), "runsc-lost-reply")
	script := `#!/bin/sh
for a in "$@"; do
	if [ "$a" = checkpoint ]; then
		"` + runsc + `" "$@" || exit $?
		echo 'checkpoint failed: checkpointing container "x": urpc method "containerManager.Checkpoint" failed: EOF' >&2
		exit 128
	fi
done
exec "` + runsc + `" "$@"
`
	if err := os.WriteFile(w, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return w
}

func driverWith(t *testing.T, bin string) *Driver {
	t.Helper()
	root := t.TempDir()
	d, err := New(Config{Binary: bin, Root: root, Checkpoint: true, Debug: os.Getenv("CUBE_GVISOR_DEBUG") != "",
		Logger: slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { assertNoRunscLeft(t, d, root) })
	return d
}

// TestCheckpointLostReply: runsc fails a checkpoint with "EOF" after the
// sentry saved the sandbox whole (its reply lost as the sandbox exited).
// The checkpoint counts: Checkpoint (leaveRunning, and stopped) succeeds,
// says so in its log and counter, and the sandbox restored from the image
// holds its memory. The control, TestCheckpointSentryDied, shows the same
// runsc error failing the checkpoint when the sentry did not finish.
func TestCheckpointLostReply(t *testing.T) {
	requireRunsc(t)
	d, parent := driverWith(t, lostReplyRunsc(t)), cgroupParent(t)
	id := "lost-reply"
	spec := startCounter(t, d, parent, id)
	prev := readState(t, d, id)
	before := LostCheckpointReplies()
	if err := d.Checkpoint(t.Context(), id, filepath.Join(t.TempDir(), "img"), true); err != nil {
		t.Fatalf("Checkpoint(leaveRunning) whose runsc lost the reply: %v", err)
	}
	if st, err := d.State(t.Context(), id); err != nil || st.Status != runtime.StatusRunning {
		t.Fatalf("after checkpoint: %+v, %v; want running", st, err)
	}
	prev = wantContinued(t, d, id, prev)

	dir := filepath.Join(t.TempDir(), "img2")
	if err := d.Checkpoint(t.Context(), id, dir, false); err != nil {
		t.Fatalf("Checkpoint whose runsc lost the reply: %v", err)
	}
	if st, err := d.State(t.Context(), id); err != nil || st.Status != runtime.StatusStopped {
		t.Fatalf("after checkpoint: %+v, %v; want stopped", st, err)
	}
	if got := LostCheckpointReplies() - before; got != 2 {
		t.Fatalf("LostCheckpointReplies went up by %d, want 2", got)
	}
	if err := d.Stop(t.Context(), id); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Restore(t.Context(), spec, dir); err != nil {
		t.Fatalf("Restore from the image of the lost reply: %v", err)
	}
	wantContinued(t, d, id, prev)
}

// sandboxPID is the host PID of id's sandbox process (runsc-sandbox).
func sandboxPID(t *testing.T, d *Driver, id string) int {
	t.Helper()
	for _, p := range runscProcs(d.root) {
		pid, cmd, _ := strings.Cut(p, ": ")
		if strings.HasPrefix(cmd, "runsc-sandbox ") && strings.Contains(cmd, " boot ") && strings.Contains(cmd, runscID(id)) {
			n, err := strconv.Atoi(pid)
			if err == nil {
				return n
			}
		}
	}
	t.Fatalf("no runsc-sandbox process of %s", id)
	return 0
}

// TestCheckpointSentryDied is the control of TestCheckpointLostReply:
// the sandbox process is killed while the sentry saves (its log says the
// save started, never that it ended), so runsc's checkpoint fails with
// the same "EOF". The checkpoint must fail, saying the sandbox stopped:
// the partial image is never taken for a whole one.
func TestCheckpointSentryDied(t *testing.T) {
	requireRunsc(t)
	d, parent := newTestDriver(t), cgroupParent(t)
	for try := range 3 {
		id := "sentry-died-" + strconv.Itoa(try)
		spec := shellSpec(t, parent, id, counterScript)
		stopAtEnd(t, d, id)
		if _, err := d.Start(t.Context(), spec); err != nil {
			t.Fatalf("Start: %v", err)
		}
		readState(t, d, id)
		pid := sandboxPID(t, d, id)
		log := d.sentryLog(spec.BundleDir)
		done := make(chan error, 1)
		go func() { done <- d.Checkpoint(t.Context(), id, filepath.Join(t.TempDir(), "img"), false) }()
		// Kill the sandbox as soon as the sentry says it started saving.
		deadline := time.Now().Add(20 * time.Second)
		for {
			b, _ := os.ReadFile(log)
			if strings.Contains(string(b), saveStarted) || time.Now().After(deadline) {
				break
			}
			time.Sleep(time.Millisecond)
		}
		_ = syscall.Kill(pid, syscall.SIGKILL)
		err := <-done
		verdict, _ := saveVerdict(log)
		t.Logf("try %d: sandbox process %d killed mid-save; sentry's verdict %q; Checkpoint: %v", try, pid, verdict, err)
		if verdict == "ok" {
			if err != nil {
				t.Fatalf("the save finished before the kill, yet Checkpoint failed: %v", err)
			}
			continue // the save won the race: try again
		}
		if err == nil {
			t.Fatalf("Checkpoint succeeded although the sentry died mid-save")
		}
		if !strings.Contains(err.Error(), "EOF") || !strings.Contains(err.Error(), "runsc stopped the sandbox") {
			t.Fatalf("Checkpoint error %q: want runsc's EOF and that the sandbox stopped", err)
		}
		return
	}
	t.Fatalf("the save finished before the kill in every try: the control tested nothing")
}
