package gvisor

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/runtime/cgroups"
	"github.com/cubesandbox/cube/internal/testenv"
)

// memCgroup makes a cgroup v1 memory directory under a test parent with
// the limits runsc gives a sandbox whose spec says ml (memory+swap equal
// to memory: no swap), and a tmpfs whose pages a "guest" charges to it
// (fill). Both go when the test ends.
func memCgroup(t *testing.T, ml memLimits) (cgroupPath, dir string, fill func(name string, mib int) error, free func(name string)) {
	t.Helper()
	testenv.RequireRoot(t, "makes cgroups and mounts a tmpfs")
	mounts, err := cgroups.Mounts()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range mounts {
		if _, err := os.Stat(filepath.Join(m, "memory.limit_in_bytes")); err == nil {
			dir = m
		}
	}
	if dir == "" {
		testenv.Missing(t, "no cgroup v1 memory hierarchy")
	}
	cgroupPath = cgroupParent(t) + "/memlimit"
	dir = filepath.Join(dir, cgroupPath)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	shm := t.TempDir()
	if err := syscall.Mount("cube-memlimit", shm, "tmpfs", 0, "size=512m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = syscall.Unmount(shm, syscall.MNT_DETACH) // uncharges the pages
		if _, err := cgroups.Remove(cgroupPath, 2*time.Second); err != nil {
			t.Errorf("remove %s: %v", cgroupPath, err)
		}
	})
	for _, f := range []string{"memory.limit_in_bytes", "memory.memsw.limit_in_bytes"} {
		if err := writeInt(filepath.Join(dir, f), ml.limit); err != nil {
			t.Fatal(err)
		}
	}
	fill = func(name string, mib int) error {
		// A short-lived process in the cgroup writes the file: tmpfs pages
		// stay charged to the cgroup after it exits (no swap to go to).
		// At the cgroup's limit the kernel OOM-kills it.
		out, err := exec.Command("/bin/sh", "-c", `echo $$ > "$1/cgroup.procs" && head -c "$2" /dev/zero > "$3"`,
			"sh", dir, strconv.Itoa(mib<<20), filepath.Join(shm, name)).CombinedOutput()
		if err != nil {
			return fmt.Errorf("fill %s with %d MiB: %w: %s", name, mib, err, out)
		}
		return nil
	}
	free = func(name string) {
		if err := os.Remove(filepath.Join(shm, name)); err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
	}
	return cgroupPath, dir, fill, free
}

func readInt(t *testing.T, path string) int64 {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// shortLowering makes lowerMemory's waits test-sized.
func shortLowering(t *testing.T) {
	w, e, b := lowerWait, lowerEvery, lowerBound
	lowerWait, lowerEvery, lowerBound = 200*time.Millisecond, 50*time.Millisecond, time.Minute
	t.Cleanup(func() { lowerWait, lowerEvery, lowerBound = w, e, b })
}

// TestSaveHeadroomNoRatchet: a sandbox whose guest grew past its limit
// while a save had it lifted (the save then failed and left it running)
// cannot be lowered back (v1: EBUSY). Checkpoint after checkpoint, the
// limit must never go above the spec's limit plus the headroom, the
// spec's limit must be enforced meanwhile (soft limit), and once the
// guest fits again the limit must end at the spec's. The control lifts
// from the cgroup's current limit, as the driver did: every failed
// lowering (the guest grew past the limit lifted from) then left the next
// lift 64 MiB higher.
func TestSaveHeadroomNoRatchet(t *testing.T) {
	shortLowering(t)
	const mib = 1 << 20
	ml := memLimits{limit: 32 * mib, swap: 32 * mib}
	// Each round the guest grows by grow while the limit is lifted.
	const rounds, grow = 3, 50

	t.Run("control: lift from the current limit ratchets", func(t *testing.T) {
		cg, dir, fill, free := memCgroup(t, ml)
		if err := fill("base", 16); err != nil {
			t.Fatal(err)
		}
		limit := filepath.Join(dir, "memory.limit_in_bytes")
		liftFromCurrent := func(by int64) func() error {
			var old []string
			for _, f := range []string{"memory.memsw.limit_in_bytes", "memory.limit_in_bytes"} {
				cur := readInt(t, filepath.Join(dir, f))
				old = append(old, strconv.FormatInt(cur, 10))
				if err := writeInt(filepath.Join(dir, f), cur+by); err != nil {
					t.Fatal(err)
				}
			}
			return func() error {
				if err := os.WriteFile(limit, []byte(old[1]), 0); err != nil {
					return err
				}
				return os.WriteFile(filepath.Join(dir, "memory.memsw.limit_in_bytes"), []byte(old[0]), 0)
			}
		}
		for r := range rounds {
			lower := liftFromCurrent(64 * mib)
			ferr := fill(fmt.Sprint("grown-", r), grow)
			err := lower()
			t.Logf("control round %d: the guest grew by %d MiB (%v)", r, grow, ferr)
			t.Logf("control round %d: lowering: %v; limit now %d MiB", r, err, readInt(t, limit)/mib)
		}
		got := readInt(t, limit)
		if got <= ml.limit+64*mib {
			t.Fatalf("control: limit %d MiB after %d lifts from the current limit; the probe did not ratchet", got/mib, rounds)
		}
		t.Logf("control: lifting from the current limit ended at %d MiB for a spec of %d MiB (cgroup %s)", got/mib, ml.limit/mib, cg)
		for r := range rounds {
			free(fmt.Sprint("grown-", r))
		}
	})

	cg, dir, fill, free := memCgroup(t, ml)
	d := &Driver{headroom: 64 * mib, log: slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))}
	t.Cleanup(func() { d.stopLowering(cg) })
	if err := fill("base", 16); err != nil {
		t.Fatal(err)
	}
	limit := filepath.Join(dir, "memory.limit_in_bytes")
	memsw := filepath.Join(dir, "memory.memsw.limit_in_bytes")
	soft := filepath.Join(dir, "memory.soft_limit_in_bytes")
	ceiling := ml.limit + d.headroom
	kept0, _ := MemoryHeadroomKept()
	for r := range rounds {
		if err := d.liftMemory(cg, ml); err != nil {
			t.Fatalf("round %d: lift: %v", r, err)
		}
		if got, sw := readInt(t, limit), readInt(t, memsw); got != ceiling || sw != ceiling {
			t.Fatalf("round %d: lifted to %d/%d MiB, want the spec's %d + %d MiB", r, got/mib, sw/mib, ml.limit/mib, d.headroom/mib)
		}
		// The guest grows while the limit is lifted, past the spec's
		// limit (and, from the second round, as far as the lift lets it:
		// the kernel OOM-kills the writer there).
		ferr := fill(fmt.Sprint("grown-", r), grow)
		t.Logf("round %d: the guest grew by up to %d MiB (%v); %d MiB charged", r, grow, ferr, readInt(t, filepath.Join(dir, "memory.usage_in_bytes"))/mib)
		d.lowerMemory(t.Context(), "memlimit", cg, ml)
		got := readInt(t, limit)
		t.Logf("round %d: the guest holds more than its limit; limit after the lowering %d MiB, soft limit %d MiB", r, got/mib, readInt(t, soft)/mib)
		if got > ceiling || got <= ml.limit {
			t.Fatalf("round %d: limit %d MiB; want above the spec's %d MiB (the kernel refuses it) and at most %d MiB", r, got/mib, ml.limit/mib, ceiling/mib)
		}
		if s := readInt(t, soft); s != ml.limit {
			t.Fatalf("round %d: soft limit %d, want the spec's limit %d while the headroom is kept", r, s, ml.limit)
		}
		time.Sleep(3 * lowerEvery) // the background lowering steps down meanwhile
		if now := readInt(t, limit); now > got {
			t.Fatalf("round %d: the background lowering raised the limit: %d -> %d MiB", r, got/mib, now/mib)
		}
	}
	if kept, _ := MemoryHeadroomKept(); kept-kept0 != rounds {
		t.Fatalf("headroom kept counted %d times, want %d", kept-kept0, rounds)
	}
	// The guest fits again: the background lowering brings the limit
	// back to the spec's.
	for r := range rounds {
		free(fmt.Sprint("grown-", r))
	}
	deadline := time.Now().Add(10 * time.Second)
	for readInt(t, limit) != ml.limit {
		if time.Now().After(deadline) {
			t.Fatalf("limit %d MiB 10 s after the guest fits again; want the spec's %d MiB", readInt(t, limit)/mib, ml.limit/mib)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if _, ok := d.lowerers.Load(cg); ok {
		// The lowerer deletes itself right after its last write.
		time.Sleep(100 * time.Millisecond)
		if _, ok := d.lowerers.Load(cg); ok {
			t.Fatal("background lowering still registered after it succeeded")
		}
	}
	// Checkpoints of a guest that fits end at the spec's limits.
	kept1, _ := MemoryHeadroomKept()
	for r := range rounds {
		if err := d.liftMemory(cg, ml); err != nil {
			t.Fatal(err)
		}
		if got := readInt(t, limit); got != ceiling {
			t.Fatalf("fitting round %d: lifted to %d MiB, want %d", r, got/mib, ceiling/mib)
		}
		d.lowerMemory(t.Context(), "memlimit", cg, ml)
	}
	if got, sw := readInt(t, limit), readInt(t, memsw); got != ml.limit || sw != ml.swap {
		t.Fatalf("after %d checkpoints of a guest that fits: limits %d/%d MiB, want the spec's %d/%d", rounds, got/mib, sw/mib, ml.limit/mib, ml.swap/mib)
	}
	if s := readInt(t, soft); s < unlimited {
		t.Fatalf("soft limit %d left after the limit came back", s)
	}
	if kept, _ := MemoryHeadroomKept(); kept != kept1 {
		t.Fatalf("headroom counted as kept for a guest that fits")
	}
	t.Logf("%d lifts over a guest past its limit stayed within %d MiB; the limit came back to %d MiB", rounds, ceiling/mib, ml.limit/mib)
}

// TestFailedRestoreRemovesRoom: a restore whose launch fails without
// touching runsc's state of the ID (another sandbox of that ID appeared
// between the driver's check and runsc's: runsc says "already exists",
// and the rollback must leave that sandbox alone) still removes the
// cgroup v1 memory directory it made with raised limits (restoreRoom);
// a later sandbox of that cgroup path would take it over as it is. The
// control is the same restore without the race: it succeeds, and its
// cgroup holds the spec's limit.
func TestFailedRestoreRemovesRoom(t *testing.T) {
	requireRunsc(t)
	d, parent := newTestDriver(t), cgroupParent(t)
	src := startCounter(t, d, parent, "room-src")
	img := filepath.Join(t.TempDir(), "img")
	if err := d.Checkpoint(t.Context(), src.ID, img, false); err != nil {
		t.Fatal(err)
	}
	memDir := func(cgroupPath string) string {
		mounts, _ := cgroups.Mounts()
		for _, m := range mounts {
			if _, err := os.Stat(filepath.Join(m, "memory.limit_in_bytes")); err == nil {
				return filepath.Join(m, cgroupPath)
			}
		}
		testenv.Missing(t, "no cgroup v1 memory hierarchy: restores get no room")
		return ""
	}

	const id = "room-victim"
	victim := src
	victim.ID, victim.CgroupPath = id, parent+"/"+id
	victim.BundleDir = filepath.Join(t.TempDir(), "bundle")
	other := shellSpec(t, parent, id, counterScript)
	other.CgroupPath = parent + "/" + id + "-other"
	stopAtEnd(t, d, id)
	t.Cleanup(func() {
		_, _ = cgroups.Kill(other.CgroupPath, 2*time.Second)
		_, _ = cgroups.Remove(other.CgroupPath, 2*time.Second)
	})
	t.Cleanup(func() { failpoint.Disable(FailpointLaunchRoom) })
	var sawRoom bool
	if err := failpoint.EnableFunc(FailpointLaunchRoom, func(ctx context.Context) error {
		failpoint.Disable(FailpointLaunchRoom)
		_, err := os.Stat(memDir(victim.CgroupPath))
		sawRoom = err == nil
		_, err = d.Start(context.WithoutCancel(ctx), other)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	_, err := d.Restore(t.Context(), victim, img)
	t.Logf("restore raced by another sandbox of its ID: %v (the restore's cgroup existed before runsc ran: %v)", err, sawRoom)
	if !errdefs.IsAlreadyExists(err) {
		t.Fatalf("Restore = %v, want AlreadyExists", err)
	}
	if !sawRoom {
		t.Fatal("no cgroup was made for the restore: the probe tested nothing")
	}
	if _, err := os.Stat(memDir(victim.CgroupPath)); !os.IsNotExist(err) {
		t.Fatalf("the cgroup made for the failed restore is still there (%v)", err)
	}
	// runsc's failed restore removes the other sandbox's state file
	// (runsc 20221219), so Stop no longer finds it: its processes go
	// with its cgroup.
	if err := d.Stop(t.Context(), id); err != nil {
		t.Fatal(err)
	}
	if _, err := cgroups.Kill(other.CgroupPath, 2*time.Second); err != nil {
		t.Fatal(err)
	}
	if _, err := cgroups.Remove(other.CgroupPath, 2*time.Second); err != nil {
		t.Fatal(err)
	}

	// Control: no race, the restore succeeds into its room and ends at
	// the spec's limit.
	if _, err := d.Restore(t.Context(), victim, img); err != nil {
		t.Fatalf("control: Restore: %v", err)
	}
	lim, ok := readLimit(filepath.Join(memDir(victim.CgroupPath), "memory.limit_in_bytes"))
	t.Logf("control: restored; memory limit %d MiB (spec %d MiB)", lim>>20, victim.Limits.MemoryMiB)
	if !ok || lim > victim.Limits.MemoryMiB<<20+d.headroom {
		t.Fatalf("control: memory limit %d", lim)
	}
}
