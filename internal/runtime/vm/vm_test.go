package vm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime"
)

const bootLimit = 90 * time.Second

// TestLifecycleSnapshotClone boots one VM to a ready agent and takes it
// through pause/resume, a checkpoint that leaves it paused, one that
// quits it, and three concurrent restores of that image, each with its
// own disk and sockets; the argv of a process started at run time,
// kept only in guest memory, proves the memory came back.
func TestLifecycleSnapshotClone(t *testing.T) {
	e := newEnv(t)
	d, ctx := e.d, t.Context()
	spec := e.spec(t, "life")
	stopAtEnd(t, d, spec.ID)

	begin := time.Now()
	st, err := d.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("cold boot: QEMU running after %v (accel %s)", time.Since(begin), d.Accel())
	if st.Status != runtime.StatusRunning || st.PID <= 0 {
		t.Fatalf("Start = %+v", st)
	}
	if err := inCgroup(spec.CgroupPath, st.PID); err != nil {
		t.Errorf("QEMU not in its cgroup: %v", err)
	}
	wantMemoryLimit(t, spec.CgroupPath, (256+overheadTCGMiB)<<20, d.Accel())
	c := agentClient(ctx, t, d, spec.ID, bootLimit)
	t.Logf("cold boot: agent ready after %v", time.Since(begin))
	if got := strings.TrimSpace(run(ctx, t, c, "hostname")); got != "life" {
		t.Errorf("guest hostname %q, want life (from Spec.Hostname)", got)
	}
	// The console: a guest write reaches console.log (the driver's file,
	// QEMU's fd set) until sealed, then only QEMU's ring buffer.
	con, err := d.ConsoleLog(spec.ID)
	if err != nil {
		t.Fatal(err)
	}
	run(ctx, t, c, "echo console-before-seal >/dev/ttyS0")
	waitFileHas(t, con, "console-before-seal")
	if err := d.SealConsole(ctx, spec.ID); err != nil {
		t.Fatalf("SealConsole: %v", err)
	}
	run(ctx, t, c, "echo console-after-seal >/dev/ttyS0")
	var ring string
	if err := d.execute(ctx, mustLoad(t, d, spec.ID), "ringbuf-read", map[string]any{"device": ConsoleChardev, "size": consoleRing, "format": "utf8"}, &ring); err != nil {
		t.Fatalf("ringbuf-read: %v", err)
	}
	if !strings.Contains(ring, "console-after-seal") {
		t.Errorf("sealed console ring lacks the guest's write: %q", ring)
	}
	if b, _ := os.ReadFile(con); strings.Contains(string(b), "console-after-seal") {
		t.Errorf("console.log still grows after SealConsole")
	}

	// The marker lives only in guest memory: a detached process's argv.
	marker := fmt.Sprintf("%d", 100000+time.Now().UnixNano()%1e8)
	run(ctx, t, c, "setsid sleep "+marker+" </dev/null >/dev/null 2>&1 &")
	const probe = "cat /proc/[0-9]*/cmdline | tr '\\0' ' ' | grep -o 'sleep [0-9]*' | head -1"

	// Pause / resume.
	if err := d.Pause(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	wantState(t, d, spec.ID, runtime.StatusPaused)
	// Checkpoint of a paused VM with leaveRunning: it stays paused.
	img1 := filepath.Join(t.TempDir(), "img1")
	if err := d.Checkpoint(ctx, spec.ID, img1, true); err != nil {
		t.Fatal(err)
	}
	wantState(t, d, spec.ID, runtime.StatusPaused)
	if err := d.Resume(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	wantState(t, d, spec.ID, runtime.StatusRunning)
	if got := strings.TrimSpace(run(ctx, t, c, probe)); got != "sleep "+marker {
		t.Errorf("after pause+checkpoint+resume: %q, want sleep %s", got, marker)
	}

	// Checkpoint of a running VM without leaveRunning: it is gone after.
	img := filepath.Join(t.TempDir(), "img")
	begin = time.Now()
	if err := d.Checkpoint(ctx, spec.ID, img, false); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(filepath.Join(img, MemoryFile))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("checkpoint: %v, %s %d KiB", time.Since(begin), MemoryFile, fi.Size()>>10)
	if _, err := d.State(ctx, spec.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("State after Checkpoint(leaveRunning=false) = %v, want ErrNotFound", err)
	}
	wantNoFiles(t, spec.BundleDir)
	entries, _ := os.ReadDir(img)
	if len(entries) != 2 {
		t.Errorf("checkpoint dir holds %d entries, want memory.zst and vm.json", len(entries))
	}

	// Three clones at once, each on its own copy of the disk.
	var wg sync.WaitGroup
	errs := make([]error, 3)
	specs := make([]runtime.Spec, 3)
	for i := range specs {
		specs[i] = e.spec(t, fmt.Sprintf("clone%d", i))
		copyFile(t, spec.Disk, specs[i].Disk)
		stopAtEnd(t, d, specs[i].ID)
	}
	begin = time.Now()
	for i := range specs {
		wg.Go(func() { _, errs[i] = d.Restore(ctx, specs[i], img) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	t.Logf("restore of 3 clones: %v", time.Since(begin))
	pids := map[int]bool{}
	for _, s := range specs {
		st := wantState(t, d, s.ID, runtime.StatusRunning)
		pids[st.PID] = true
		c := agentClient(ctx, t, d, s.ID, 30*time.Second)
		if got := strings.TrimSpace(run(ctx, t, c, probe)); got != "sleep "+marker {
			t.Errorf("%s: %q, want sleep %s (from the memory image)", s.ID, got, marker)
		}
		// Each clone writes its own disk.
		run(ctx, t, c, "echo "+s.ID+" > /root/who && sync")
		if note, _ := d.ShapeNote(s.ID); note != "" {
			t.Errorf("%s: unexpected shape note %q", s.ID, note)
		}
	}
	if len(pids) != 3 {
		t.Errorf("clones share QEMU processes: %v", pids)
	}
	for _, s := range specs {
		if err := d.Stop(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
		wantNoFiles(t, s.BundleDir)
		if err := d.Stop(ctx, s.ID); err != nil {
			t.Fatalf("second Stop: %v", err)
		}
	}
}

func wantState(t testing.TB, d *Driver, id string, want runtime.Status) runtime.State {
	t.Helper()
	st, err := d.State(context.Background(), id)
	if err != nil || st.Status != want {
		t.Fatalf("State(%s) = %+v, %v; want %s", id, st, err, want)
	}
	return st
}

// wantMemoryLimit checks the memory controller's limit on path (v1 or v2).
func wantMemoryLimit(t testing.TB, path string, want int64, accel string) {
	t.Helper()
	if accel != "tcg" {
		want += (overheadKVMMiB - overheadTCGMiB) << 20
	}
	roots, err := cgroupRoots()
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, r := range roots {
		for _, f := range []string{"memory.limit_in_bytes", "memory.max"} {
			b, err := os.ReadFile(filepath.Join(r, path, f))
			if err != nil {
				continue
			}
			found = true
			if got := strings.TrimSpace(string(b)); got != fmt.Sprint(want) {
				t.Errorf("%s/%s = %s, want %d", r, f, got, want)
			}
		}
	}
	if !found {
		t.Errorf("no memory limit file for %s", path)
	}
}

// waitFileHas waits until path contains s.
func waitFileHas(t *testing.T, path, s string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if b, _ := os.ReadFile(path); strings.Contains(string(b), s) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s never got %q", path, s)
		}
	}
}

func mustLoad(t *testing.T, d *Driver, id string) *vmState {
	t.Helper()
	st, err := d.load(id)
	if err != nil {
		t.Fatal(err)
	}
	return st
}
