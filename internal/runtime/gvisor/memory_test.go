package gvisor

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/runtimetest"
	"github.com/cubesandbox/cube/internal/testenv"
)

// counterScript keeps its state only in shell variables: a random value
// chosen at boot and a counter. It writes both to /tmp/state each tick,
// so a restored sandbox proves it holds the original's memory when it
// reports the same value and a counter that went on from where it was.
const counterScript = `v=$RANDOM$RANDOM$RANDOM; i=0; while true; do i=$((i+1)); echo "$v $i" > /tmp/state; sleep 0.05; done`

type memState struct {
	value string
	count int
}

// execIn runs a command in a sandbox with runsc exec, repeating the
// global flags the sandbox was created with.
func execIn(ctx context.Context, d *Driver, id string, args ...string) (string, error) {
	c, rid, _, err := d.lookup(ctx, id)
	if err != nil {
		return "", err
	}
	argv := append([]string{"--root", d.root, "--platform=" + d.platform, "--network=" + networkOf(c.Bundle), "exec", rid}, args...)
	out, err := exec.CommandContext(ctx, d.bin, argv...).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("runsc exec %s %v: %w: %s", id, args, err, out)
	}
	return string(out), nil
}

// readState reads the counter once it has been written at least once.
func readState(t *testing.T, d *Driver, id string) memState {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	for {
		out, err := execIn(ctx, d, id, "/bin/cat", "/tmp/state")
		if f := strings.Fields(out); err == nil && len(f) == 2 {
			n, err := strconv.Atoi(f[1])
			if err == nil {
				return memState{f[0], n}
			}
		}
		if ctx.Err() != nil {
			t.Fatalf("read state of %s: %v (%q)", id, err, out)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// wantContinued checks that id holds the value of before and a counter
// that moved on from it.
func wantContinued(t *testing.T, d *Driver, id string, before memState) memState {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := readState(t, d, id)
		if got.value != before.value {
			t.Fatalf("%s: value %q after restore, want %q (memory not restored)", id, got.value, before.value)
		}
		if got.count > before.count {
			return got
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: counter stuck at %d (was %d)", id, got.count, before.count)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func stopAtEnd(t *testing.T, d *Driver, id string) {
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := d.Stop(ctx, id); err != nil {
			t.Errorf("cleanup: Stop(%s): %v", id, err)
		}
	})
}

func startCounter(t *testing.T, d *Driver, parent, id string) runtime.Spec {
	t.Helper()
	spec := shellSpec(t, parent, id, counterScript)
	stopAtEnd(t, d, id)
	if _, err := d.Start(t.Context(), spec); err != nil {
		t.Fatalf("Start: %v", err)
	}
	return spec
}

// rounds is how many snapshot/restore rounds TestRepeatedCheckpoint does:
// 10 in CI, more with CUBE_GVISOR_ROUNDS (docs/gvisor.md reports 50).
func rounds() int {
	if n, err := strconv.Atoi(os.Getenv("CUBE_GVISOR_ROUNDS")); err == nil && n > 0 {
		return n
	}
	return 10
}

// TestRepeatedCheckpoint snapshots a live sandbox again and again
// (checkpoint, then restore in place) and checks memory and files after
// every round.
func TestRepeatedCheckpoint(t *testing.T) {
	requireRunsc(t)
	d, parent := newTestDriver(t), cgroupParent(t)
	id := "mem-repeat"
	startCounter(t, d, parent, id)
	prev := readState(t, d, id)
	for r := range rounds() {
		mark := fmt.Sprintf("round-%d", r)
		if _, err := execIn(t.Context(), d, id, "/bin/sh", "-c", "echo "+mark+" > /tmp/mark"); err != nil {
			t.Fatal(err)
		}
		dir := filepath.Join(t.TempDir(), "img")
		if err := d.Checkpoint(t.Context(), id, dir, true); err != nil {
			t.Fatalf("round %d: Checkpoint: %v", r, err)
		}
		if st, err := d.State(t.Context(), id); err != nil || st.Status != runtime.StatusRunning {
			t.Fatalf("round %d: after checkpoint: %+v, %v; want running", r, st, err)
		}
		prev = wantContinued(t, d, id, prev)
		if out, err := execIn(t.Context(), d, id, "/bin/cat", "/tmp/mark"); err != nil || strings.TrimSpace(out) != mark {
			t.Fatalf("round %d: /tmp/mark = %q, %v; want %q", r, out, err, mark)
		}
	}
}

// TestCheckpointOverStaleImage: runsc leaves a partial image behind when
// a checkpoint fails (it creates the file with O_EXCL first), which is what
// a retry after "cannot be saved in connected state" or a new attempt on
// the same snapshot directory meets. The driver clears it, the checkpoint
// succeeds and the sandbox keeps running with its memory.
func TestCheckpointOverStaleImage(t *testing.T) {
	requireRunsc(t)
	d, parent := newTestDriver(t), cgroupParent(t)
	id := "mem-stale"
	startCounter(t, d, parent, id)
	prev := readState(t, d, id)
	dir := filepath.Join(t.TempDir(), "img")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	stale := filepath.Join(dir, CheckpointFile)
	if err := os.WriteFile(stale, []byte("partial image of a failed attempt"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := d.Checkpoint(t.Context(), id, dir, true); err != nil {
		t.Fatalf("Checkpoint over a stale image: %v", err)
	}
	if st, err := d.State(t.Context(), id); err != nil || st.Status != runtime.StatusRunning {
		t.Fatalf("after checkpoint: %+v, %v; want running", st, err)
	}
	wantContinued(t, d, id, prev)
	if fi, err := os.Stat(stale); err != nil || fi.Size() < 4096 {
		t.Fatalf("image after checkpoint: %v, %v; want the new image", fi, err)
	}
}

// TestPauseToDisk is the driver side of pause-to-disk: checkpoint (the
// sandbox stops), Stop frees everything, Restore brings the memory back.
func TestPauseToDisk(t *testing.T) {
	requireRunsc(t)
	d, parent := newTestDriver(t), cgroupParent(t)
	id := "mem-p2d"
	spec := startCounter(t, d, parent, id)
	before := readState(t, d, id)
	dir := filepath.Join(t.TempDir(), "img")
	if err := d.Checkpoint(t.Context(), id, dir, false); err != nil {
		t.Fatalf("Checkpoint: %v", err)
	}
	if err := d.Stop(t.Context(), id); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if pids := runscProcs(d.root); len(pids) > 0 {
		t.Fatalf("paused to disk, yet runsc processes remain: %v", pids)
	}
	if _, err := d.Restore(t.Context(), spec, dir); err != nil {
		t.Fatalf("Restore: %v", err)
	}
	wantContinued(t, d, id, before)
}

// clones is how many sandboxes TestCloneFromCheckpoint restores at once.
func clones() int {
	if n, err := strconv.Atoi(os.Getenv("CUBE_GVISOR_CLONES")); err == nil && n > 0 {
		return n
	}
	return 3
}

// TestCloneFromCheckpoint restores several sandboxes at once from one
// image, each on its own copy of the root filesystem: every clone holds
// the original's memory and then lives on its own.
func TestCloneFromCheckpoint(t *testing.T) {
	requireRunsc(t)
	d, parent := newTestDriver(t), cgroupParent(t)
	id := "mem-orig"
	spec := startCounter(t, d, parent, id)
	before := readState(t, d, id)
	dir := filepath.Join(t.TempDir(), "img")
	if err := d.Checkpoint(t.Context(), id, dir, false); err != nil {
		t.Fatalf("Checkpoint: %v", err)
	}
	// The disk is copied while the original is stopped, so it matches
	// the image exactly.
	n := clones()
	specs := make([]runtime.Spec, n)
	for i := range specs {
		s := spec
		s.ID = fmt.Sprintf("mem-clone-%d", i)
		base := t.TempDir()
		s.BundleDir = filepath.Join(base, "bundle")
		s.RootFS = filepath.Join(base, "rootfs")
		s.CgroupPath = parent + "/" + s.ID
		if out, err := exec.Command("cp", "-a", spec.RootFS, s.RootFS).CombinedOutput(); err != nil {
			t.Fatalf("copy rootfs: %v: %s", err, out)
		}
		specs[i] = s
		stopAtEnd(t, d, s.ID)
	}
	if _, err := d.RestoreInPlace(t.Context(), id, dir); err != nil {
		t.Fatalf("RestoreInPlace of the original: %v", err)
	}
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range specs {
		wg.Go(func() { _, errs[i] = d.Restore(t.Context(), specs[i], dir) })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("Restore clone %d: %v", i, err)
		}
	}
	for _, s := range append([]runtime.Spec{spec}, specs...) {
		wantContinued(t, d, s.ID, before)
	}
	// Each clone is its own sandbox: a file written in one is not in
	// the others.
	if _, err := execIn(t.Context(), d, specs[0].ID, "/bin/sh", "-c", "echo mine > /tmp/own"); err != nil {
		t.Fatal(err)
	}
	if n > 1 {
		if out, err := execIn(t.Context(), d, specs[1].ID, "/bin/cat", "/tmp/own"); err == nil {
			t.Fatalf("clone 1 sees clone 0's file: %q", out)
		}
	}
}

// TestRollbackInPlace puts a running sandbox back to an earlier memory
// image: the counter goes back to before the later ticks.
func TestRollbackInPlace(t *testing.T) {
	requireRunsc(t)
	d, parent := newTestDriver(t), cgroupParent(t)
	id := "mem-rollback"
	startCounter(t, d, parent, id)
	// The counter runs (its value drawn) before the image is taken: an
	// image of a shell that has not started yet restores to a fresh one.
	readState(t, d, id)
	dir := filepath.Join(t.TempDir(), "img")
	if err := d.Checkpoint(t.Context(), id, dir, true); err != nil {
		t.Fatalf("Checkpoint: %v", err)
	}
	at := readState(t, d, id)
	time.Sleep(time.Second)
	later := wantContinued(t, d, id, at)
	if _, err := d.RestoreInPlace(t.Context(), id, dir); err != nil {
		t.Fatalf("RestoreInPlace: %v", err)
	}
	got := readState(t, d, id)
	if got.value != at.value || got.count >= later.count {
		t.Fatalf("after rollback %+v; want value %q and a counter below %d", got, at.value, later.count)
	}
}

// TestFailedRestoreLeavesNothing restores from a corrupt image and with a
// cancelled context: the call fails and nothing of the sandbox remains.
func TestFailedRestoreLeavesNothing(t *testing.T) {
	requireRunsc(t)
	d, parent := newTestDriver(t), cgroupParent(t)
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, CheckpointFile), []byte("not an image"), 0o600); err != nil {
		t.Fatal(err)
	}
	spec := shellSpec(t, parent, "mem-bad", counterScript)
	stopAtEnd(t, d, spec.ID)
	if _, err := d.Restore(t.Context(), spec, dir); err == nil {
		t.Fatal("Restore from a corrupt image succeeded")
	}
	if _, err := d.State(t.Context(), spec.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("State after failed restore = %v, want NotFound", err)
	}
	if _, err := d.Restore(t.Context(), spec, t.TempDir()); !errdefs.IsNotFound(err) {
		t.Fatalf("Restore from an empty dir = %v, want NotFound", err)
	}
	if err := d.Checkpoint(t.Context(), "mem-absent", t.TempDir(), false); !errdefs.IsNotFound(err) {
		t.Fatalf("Checkpoint(absent) = %v, want NotFound", err)
	}
	// Cancelled while runsc restores: the rollback must still remove it.
	good := shellSpec(t, parent, "mem-src", counterScript)
	stopAtEnd(t, d, good.ID)
	if _, err := d.Start(t.Context(), good); err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(t.TempDir(), "img")
	if err := d.Checkpoint(t.Context(), good.ID, img, false); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Millisecond)
	defer cancel()
	victim := good
	victim.ID, victim.CgroupPath = "mem-cancel", parent+"/mem-cancel"
	victim.BundleDir = filepath.Join(t.TempDir(), "bundle")
	stopAtEnd(t, d, victim.ID)
	if _, err := d.Restore(ctx, victim, img); err == nil {
		t.Log("restore finished inside 30ms; nothing to roll back")
	} else if _, err := d.State(t.Context(), victim.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("State after cancelled restore = %v, want NotFound", err)
	}
}

// TestCheckpointDisabled: with Config.Checkpoint off the driver says so
// and the memory verbs are ErrNotImplemented.
func TestCheckpointDisabled(t *testing.T) {
	requireRunsc(t)
	d, err := New(Config{Root: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	if c := d.Capabilities(); c.Checkpoint || c.Restore || !c.Pause {
		t.Fatalf("capabilities %+v", c)
	}
	runtimetest.CheckCapabilities(t, d)
	if err := d.Checkpoint(t.Context(), "x", t.TempDir(), true); !errdefs.IsNotImplemented(err) {
		t.Fatalf("Checkpoint = %v", err)
	}
	if _, err := d.Restore(t.Context(), shellSpec(t, "/cube-x", "x", "true"), t.TempDir()); !errdefs.IsNotImplemented(err) {
		t.Fatalf("Restore = %v", err)
	}
	if _, err := New(Config{Root: t.TempDir(), Platform: "qemu"}); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("New(platform qemu) = %v", err)
	}
}

// TestSandboxNetwork runs a sandbox in a named network namespace
// (--network=sandbox through the netns shim), checkpoints and restores it
// there.
func TestSandboxNetwork(t *testing.T) {
	requireRunsc(t)
	d, parent := newTestDriver(t), cgroupParent(t)
	ns := fmt.Sprintf("cube-gvtest-%d", os.Getpid())
	if out, err := exec.Command("ip", "netns", "add", ns).CombinedOutput(); err != nil {
		testenv.Missing(t, "ip netns add: %v: %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", ns).Run() })
	spec := shellSpec(t, parent, "net-sb", counterScript)
	spec.NetNSPath = "/run/netns/" + ns
	stopAtEnd(t, d, spec.ID)
	if _, err := d.Start(t.Context(), spec); err != nil {
		t.Fatalf("Start in a netns: %v", err)
	}
	before := readState(t, d, spec.ID)
	if err := d.Checkpoint(t.Context(), spec.ID, filepath.Join(t.TempDir(), "img"), true); err != nil {
		t.Fatalf("Checkpoint: %v", err)
	}
	wantContinued(t, d, spec.ID, before)
}

// TestCheckpointWhilePaused is the snapshot flow cubelet runs on a
// frozen sandbox: checkpoint (the sandbox stops), copy the disk, restore
// in place, thaw. The original carries on where it was, and a restore on
// the copy holds its memory and the files it wrote before the freeze.
func TestCheckpointWhilePaused(t *testing.T) {
	requireRunsc(t)
	d, parent := newTestDriver(t), cgroupParent(t)
	id := "mem-paused"
	spec := startCounter(t, d, parent, id)
	if _, err := execIn(t.Context(), d, id, "/bin/sh", "-c", "echo before > /tmp/mark"); err != nil {
		t.Fatal(err)
	}
	if err := d.Pause(t.Context(), id); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "img")
	if err := d.Checkpoint(t.Context(), id, dir, false); err != nil {
		t.Fatalf("Checkpoint while paused: %v", err)
	}
	if st, err := d.State(t.Context(), id); err != nil || st.Status != runtime.StatusStopped {
		t.Fatalf("after checkpoint: %+v, %v; want stopped", st, err)
	}
	clone := spec
	clone.ID, clone.CgroupPath = "mem-paused-clone", parent+"/mem-paused-clone"
	base := t.TempDir()
	clone.BundleDir, clone.RootFS = filepath.Join(base, "bundle"), filepath.Join(base, "rootfs")
	if out, err := exec.Command("cp", "-a", spec.RootFS, clone.RootFS).CombinedOutput(); err != nil {
		t.Fatalf("copy rootfs: %v: %s", err, out)
	}
	if _, err := d.RestoreInPlace(t.Context(), id, dir); err != nil {
		t.Fatalf("RestoreInPlace: %v", err)
	}
	before := readState(t, d, id)
	wantContinued(t, d, id, before)
	stopAtEnd(t, d, clone.ID)
	if _, err := d.Restore(t.Context(), clone, dir); err != nil {
		t.Fatalf("Restore: %v", err)
	}
	got := readState(t, d, clone.ID)
	if got.value != before.value {
		t.Fatalf("clone holds %q, original %q", got.value, before.value)
	}
	if out, err := execIn(t.Context(), d, clone.ID, "/bin/cat", "/tmp/mark"); err != nil || strings.TrimSpace(out) != "before" {
		t.Fatalf("clone /tmp/mark = %q, %v", out, err)
	}
	// leaveRunning on a paused sandbox brings it back paused.
	if err := d.Pause(t.Context(), id); err != nil {
		t.Fatal(err)
	}
	if err := d.Checkpoint(t.Context(), id, filepath.Join(t.TempDir(), "img"), true); err != nil {
		t.Fatalf("Checkpoint(leaveRunning) while paused: %v", err)
	}
	if st, err := d.State(t.Context(), id); err != nil || st.Status != runtime.StatusPaused {
		ents, _ := os.ReadDir(d.root)
		for _, e := range ents {
			t.Log("root has", e.Name())
		}
		t.Fatalf("after checkpoint: %+v, %v; want paused again", st, err)
	}
}
