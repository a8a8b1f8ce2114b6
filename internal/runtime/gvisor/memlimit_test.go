package gvisor

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/cgroups"
)

// memDir is cgroupPath's directory in the hierarchy that holds the
// memory controller, and whether that is cgroup v2 (a pure v2 host, or a
// hybrid one whose memory controller is on cgroup2) rather than v1.
func memDir(t *testing.T, cgroupPath string) (string, bool) {
	t.Helper()
	dirs, err := cgroups.Dirs(cgroupPath)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "memory.limit_in_bytes")); err == nil {
			return d, false
		}
		if _, err := os.Stat(filepath.Join(d, "memory.max")); err == nil {
			return d, true
		}
	}
	t.Fatalf("cgroup %s: no memory controller in any hierarchy (%v)", cgroupPath, dirs)
	return "", false
}

// v2Memory names the cgroup v2 file for each v1 memory file the tests
// read. memory.peak is the peak since the cgroup was made: cgroup v2 has
// no global reset (a write resets it for that open file only).
var v2Memory = map[string]string{
	"memory.limit_in_bytes":     "memory.max",
	"memory.usage_in_bytes":     "memory.current",
	"memory.max_usage_in_bytes": "memory.peak",
}

// memFile reads one number from cgroupPath's memory file name (named as
// cgroup v1 does; its v2 counterpart where the memory controller is on
// cgroup2).
func memFile(t *testing.T, cgroupPath, name string) int64 {
	t.Helper()
	d, v2 := memDir(t, cgroupPath)
	if v2 {
		name = v2Memory[name]
	}
	b, err := os.ReadFile(filepath.Join(d, name))
	if err != nil {
		t.Fatal(err)
	}
	s := strings.TrimSpace(string(b))
	if s == "max" { // v2: no limit
		return 1<<63 - 1
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// memStat summarises cgroupPath's memory.stat: the guest's and the
// sentry's own memory (rss, shmem: the sentry's memory file) against
// the page cache the kernel may reclaim (v1's total_ keys, v2's anon,
// shmem and file).
func memStat(t *testing.T, cgroupPath string) string {
	t.Helper()
	d, v2 := memDir(t, cgroupPath)
	b, err := os.ReadFile(filepath.Join(d, "memory.stat"))
	if err != nil {
		return err.Error()
	}
	kv := map[string]int64{}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) == 2 {
			kv[f[0]], _ = strconv.ParseInt(f[1], 10, 64)
		}
	}
	rss, shmem, cache := kv["total_rss"], kv["total_shmem"], kv["total_cache"]
	if v2 {
		rss, shmem, cache = kv["anon"], kv["shmem"], kv["file"]
	}
	return fmt.Sprintf("rss %d MiB, shmem %d MiB, other cache %d MiB", rss>>20, shmem>>20, (cache-shmem)>>20)
}

// resetPeak restarts cgroupPath's peak memory from the current usage
// (v1's memory.max_usage_in_bytes). cgroup v2 has no global reset, so
// there the peak stays the one since the cgroup was made and the test
// says so.
func resetPeak(t *testing.T, cgroupPath string) {
	t.Helper()
	d, v2 := memDir(t, cgroupPath)
	if v2 {
		t.Logf("cgroup v2: memory.peak cannot be reset; peaks below are since the sandbox started")
		return
	}
	if err := os.WriteFile(filepath.Join(d, "memory.max_usage_in_bytes"), []byte("0"), 0); err != nil {
		t.Fatal(err)
	}
}

// driverWith is a test driver whose sentry overhead is overhead (bytes,
// or NoSentryOverhead).
func driverWith(t *testing.T, overhead int64) *Driver {
	t.Helper()
	d := newTestDriver(t)
	o, err := sentryOverhead(overhead)
	if err != nil {
		t.Fatal(err)
	}
	d.overhead = o
	return d
}

// fillScript has the guest write fillMiB MiB of random data to its
// tmpfs mounts (/dev/shm, then /dev: each is 64 MiB at most, held in the
// sentry's memory, which the sandbox's cgroup is charged for) before it
// starts counting; with fillMiB 0 it only counts.
func fillScript(fillMiB int64) string {
	script := ""
	for i, dir := range []string{"/dev/shm", "/dev"} {
		n := min(fillMiB, 60)
		if n <= 0 {
			break
		}
		script += fmt.Sprintf(`head -c %dm /dev/urandom > %s/fill%d; `, n, dir, i)
		fillMiB -= n
	}
	return script + counterScript
}

func TestSentryOverheadSpec(t *testing.T) {
	for _, c := range []struct {
		cfg, want int64
		err       bool
	}{{0, DefaultSentryOverhead, false}, {NoSentryOverhead, 0, false}, {32 << 20, 32 << 20, false}, {-2, 0, true}} {
		got, err := sentryOverhead(c.cfg)
		if (err != nil) != c.err || got != c.want {
			t.Errorf("sentryOverhead(%d) = %d, %v; want %d (error %v)", c.cfg, got, err, c.want, c.err)
		}
		if c.err && !errdefs.IsInvalidArgument(err) {
			t.Errorf("sentryOverhead(%d): %v, want InvalidArgument", c.cfg, err)
		}
	}
	d := &Driver{overhead: 64 << 20}
	s := runtime.Spec{ID: "x", RootFS: "/r", Args: []string{"/bin/true"}, Limits: runtime.Limits{MemoryMiB: 100}}
	for range 2 { // the same spec gives the same limit every time
		sp, err := d.specFor(s)
		if err != nil {
			t.Fatal(err)
		}
		m := sp.Linux.Resources.Memory
		if *m.Limit != 164<<20 || *m.Swap != 164<<20 {
			t.Fatalf("limit %d swap %d, want %d both (guest 100 MiB + 64 MiB, no swap)", *m.Limit, *m.Swap, 164<<20)
		}
		if got := sp.Annotations[GuestMemoryAnnotation]; got != strconv.FormatInt(100<<20, 10) {
			t.Fatalf("annotation %q, want the guest's %d", got, 100<<20)
		}
	}
	// No memory limit in the spec: none in the cgroup either.
	s.Limits.MemoryMiB = 0
	sp, err := d.specFor(s)
	if err != nil {
		t.Fatal(err)
	}
	if r := sp.Linux.Resources; r != nil && r.Memory != nil && r.Memory.Limit != nil {
		t.Fatalf("unlimited spec got limit %d", *r.Memory.Limit)
	}
}

// TestMeasureSentryMemory prints the cgroup's peak memory while a 64 MiB
// gVisor sandbox boots, is checkpointed and restored in place and to
// disk, for a busybox guest and for one that filled its limit: the
// figures DefaultSentryOverhead is chosen from (docs/gvisor.md). The
// driver gets 1 GiB of overhead so that nothing is cut short. It only
// runs with CUBE_GVISOR_MEASURE_MEM=1.
func TestMeasureSentryMemory(t *testing.T) {
	requireRunsc(t)
	if os.Getenv("CUBE_GVISOR_MEASURE_MEM") == "" {
		t.Skip("set CUBE_GVISOR_MEASURE_MEM=1 to measure")
	}
	d, parent := driverWith(t, 1<<30), cgroupParent(t)
	for _, fill := range []int64{0, 32, 48, 56, 60} {
		id := fmt.Sprintf("meas-%d", fill)
		spec := shellSpec(t, parent, id, fillScript(fill))
		spec.Limits.MemoryMiB = 64
		stopAtEnd(t, d, id)
		if _, err := d.Start(t.Context(), spec); err != nil {
			t.Fatal(err)
		}
		st := readState(t, d, id)
		if mi, err := execIn(t.Context(), d, id, "/bin/busybox", "head", "-n", "2", "/proc/meminfo"); err == nil {
			t.Logf("%s: guest's /proc/meminfo: %q", id, mi)
		}
		line := fmt.Sprintf("guest fill %2d MiB: running %3d MiB (peak %3d)", fill,
			memFile(t, spec.CgroupPath, "memory.usage_in_bytes")>>20, memFile(t, spec.CgroupPath, "memory.max_usage_in_bytes")>>20)
		for round := range 2 {
			resetPeak(t, spec.CgroupPath)
			if err := d.Checkpoint(t.Context(), id, filepath.Join(t.TempDir(), "img"), true); err != nil {
				t.Fatal(err)
			}
			st = wantContinued(t, d, id, st)
			line += fmt.Sprintf("; in place #%d: peak %3d, after %3d", round+1,
				memFile(t, spec.CgroupPath, "memory.max_usage_in_bytes")>>20, memFile(t, spec.CgroupPath, "memory.usage_in_bytes")>>20)
		}
		// To disk: the save's peak is read before the sandbox stops.
		img := filepath.Join(t.TempDir(), "img")
		resetPeak(t, spec.CgroupPath)
		_, rid, _, err := d.lookup(t.Context(), id)
		if err != nil {
			t.Fatal(err)
		}
		if err := d.runCheckpoint(t.Context(), id, rid, img, "none", filepath.Join(spec.BundleDir, "runsc.log")); err != nil {
			t.Fatal(err)
		}
		line += fmt.Sprintf("; save %3d", memFile(t, spec.CgroupPath, "memory.max_usage_in_bytes")>>20)
		if err := d.stopCheckpointed(t.Context(), id, rid, spec.BundleDir); err != nil {
			t.Fatal(err)
		}
		if err := d.Stop(t.Context(), id); err != nil {
			t.Fatal(err)
		}
		if _, err := d.Restore(t.Context(), spec, img); err != nil {
			t.Fatal(err)
		}
		wantContinued(t, d, id, st)
		line += fmt.Sprintf("; restore from disk: peak %3d, after %3d", memFile(t, spec.CgroupPath, "memory.max_usage_in_bytes")>>20,
			memFile(t, spec.CgroupPath, "memory.usage_in_bytes")>>20)
		t.Log(line)
		if err := d.Stop(t.Context(), id); err != nil {
			t.Fatal(err)
		}
	}
}

// fullRounds is how many times TestCheckpointFullGuest checkpoints and
// restores in place, and then to disk (CUBE_GVISOR_FULL_ROUNDS, default 5).
func envInt(name string, def int64) int64 {
	if n, err := strconv.ParseInt(os.Getenv(name), 10, 64); err == nil && n > 0 {
		return n
	}
	return def
}

func fullRounds() int {
	if n, err := strconv.Atoi(os.Getenv("CUBE_GVISOR_FULL_ROUNDS")); err == nil && n > 0 {
		return n
	}
	return 5
}

// fullGuest checkpoints and restores sandbox id (spec), whose guest
// filled fillMiB of its limit, rounds times in place and rounds times to
// disk (checkpoint, stop, restore from the image as a drain's move
// does), checking each time that the guest's memory came back. It
// returns the first failure, naming the step.
func fullGuest(t *testing.T, d *Driver, spec runtime.Spec, rounds int) error {
	ctx := t.Context()
	if _, err := d.Start(ctx, spec); err != nil {
		return fmt.Errorf("start: %w", err)
	}
	st, err := readStateErr(ctx, d, spec.ID, time.Minute)
	if err != nil {
		return fmt.Errorf("boot: %w", err)
	}
	limit := memFile(t, spec.CgroupPath, "memory.limit_in_bytes")
	t.Logf("%s: cgroup limit %d MiB, %d MiB charged before the first checkpoint", spec.ID, limit>>20, memFile(t, spec.CgroupPath, "memory.usage_in_bytes")>>20)
	check := func(step string) error {
		got, err := readStateErr(ctx, d, spec.ID, 10*time.Second)
		if err != nil {
			return fmt.Errorf("%s: %w", step, err)
		}
		if got.value != st.value || got.count < st.count {
			return fmt.Errorf("%s: guest state %+v after restore, want %q counting on from %d", step, got, st.value, st.count)
		}
		if l := memFile(t, spec.CgroupPath, "memory.limit_in_bytes"); l != limit {
			return fmt.Errorf("%s: cgroup limit %d after restore, want %d as set at start", step, l, limit)
		}
		st = got
		return nil
	}
	for r := range rounds {
		step := fmt.Sprintf("in place #%d", r+1)
		if err := d.Checkpoint(ctx, spec.ID, filepath.Join(t.TempDir(), "img"), true); err != nil {
			return fmt.Errorf("%s: %w", step, err)
		}
		if err := check(step); err != nil {
			return err
		}
		t.Logf("%s: %s ok, %d MiB charged (%s)", spec.ID, step, memFile(t, spec.CgroupPath, "memory.usage_in_bytes")>>20, memStat(t, spec.CgroupPath))
	}
	for r := range rounds {
		step := fmt.Sprintf("to disk #%d", r+1)
		img := filepath.Join(t.TempDir(), "img")
		if err := d.Checkpoint(ctx, spec.ID, img, false); err != nil {
			return fmt.Errorf("%s: checkpoint: %w", step, err)
		}
		if err := d.Stop(ctx, spec.ID); err != nil {
			return fmt.Errorf("%s: stop: %w", step, err)
		}
		if _, err := d.Restore(ctx, spec, img); err != nil {
			return fmt.Errorf("%s: restore: %w", step, err)
		}
		if err := check(step); err != nil {
			return err
		}
		t.Logf("%s: %s ok, %d MiB charged (%s)", spec.ID, step, memFile(t, spec.CgroupPath, "memory.usage_in_bytes")>>20, memStat(t, spec.CgroupPath))
	}
	return nil
}

// readStateErr is readState that returns its failure (a sandbox the
// OOM killer ended never answers).
func readStateErr(ctx context.Context, d *Driver, id string, wait time.Duration) (memState, error) {
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	for {
		out, err := execIn(ctx, d, id, "/bin/cat", "/tmp/state")
		if f := strings.Fields(out); err == nil && len(f) == 2 {
			if n, err := strconv.Atoi(f[1]); err == nil {
				return memState{f[0], n}, nil
			}
		}
		if ctx.Err() != nil {
			return memState{}, fmt.Errorf("read the guest's state: %v (%q)", err, out)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestCheckpointFullGuest: a 64 MiB gVisor sandbox (the cluster drain's
// size) whose guest filled 56 MiB of its limit is checkpointed and
// restored in place and to disk, fullRounds times each, with the
// driver's default sentry overhead. The control runs a guest that filled
// half as much with no overhead (the cgroup at the guest's limit, as
// before the overhead existed): the OOM killer ends the sentry in a save
// or a restore (runsc: EOF), the sandbox lost.
func TestCheckpointFullGuest(t *testing.T) {
	requireRunsc(t)
	rounds := fullRounds()
	overhead := int64(0) // the default
	if n, err := strconv.Atoi(os.Getenv("CUBE_GVISOR_OVERHEAD_MIB")); err == nil {
		overhead = int64(n) << 20
	}
	// The guest's limit and fill of the overhead case; other values
	// measure what larger guests need (docs/gvisor.md).
	limit, fill := envInt("CUBE_GVISOR_FULL_LIMIT_MIB", 64), envInt("CUBE_GVISOR_FULL_FILL_MIB", 56)
	for _, c := range []struct {
		name        string
		overhead    int64
		limit, fill int64
		fails       bool
	}{
		{"control: no overhead", NoSentryOverhead, 64, 32, true},
		{"sentry overhead", overhead, limit, fill, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			d, parent := driverWith(t, c.overhead), cgroupParent(t)
			spec := shellSpec(t, parent, "full", fillScript(c.fill))
			spec.Limits.MemoryMiB = c.limit
			stopAtEnd(t, d, spec.ID)
			begin := time.Now()
			err := fullGuest(t, d, spec, rounds)
			kills, _ := cgroups.OOMKills(spec.CgroupPath)
			t.Logf("guest filled %d of %d MiB, overhead %d MiB: %d rounds in place and to disk: err %v; OOM kills in the cgroup %d; %s",
				c.fill, c.limit, d.overhead>>20, rounds, err, kills, time.Since(begin).Round(time.Millisecond))
			switch {
			case c.fails && err == nil:
				t.Fatalf("without the overhead every round survived; the control was expected to lose the sandbox to the OOM killer")
			case c.fails && kills == 0:
				t.Fatalf("without the overhead it failed, but not by the OOM killer (no OOM kill in the cgroup): %v", err)
			case !c.fails && err != nil:
				t.Fatalf("with %d MiB overhead: %v (OOM kills %d)", d.overhead>>20, err, kills)
			case !c.fails && kills != 0:
				t.Fatalf("with %d MiB overhead: %d OOM kills in the cgroup", d.overhead>>20, kills)
			}
		})
	}
}

// hogScript has the guest's shell double a string until it holds
// 2^steps bytes (plus the copy the last doubling makes), then say so and
// sleep: guest memory, charged to the sandbox's cgroup through the
// sentry.
func hogScript(steps int) string {
	return fmt.Sprintf(`x=a; i=0; while [ $i -lt %d ]; do x="$x$x"; i=$((i+1)); done; echo "held ${#x}" > /tmp/held; sleep 1000`, steps)
}

// TestGuestBeyondItsLimit: the overhead is room for gVisor, not for the
// guest. A guest of a 64 MiB sandbox that allocates 256 MiB (more than
// its limit plus the overhead) is stopped: the OOM killer ends the
// sandbox, its cgroup never charged above the limit set at start (guest
// plus overhead), and it holds none of it afterwards. The control runs
// the same guest in a sandbox whose spec allows 512 MiB: it holds the
// 256 MiB, so the probe allocates what it says.
func TestGuestBeyondItsLimit(t *testing.T) {
	requireRunsc(t)
	d := driverWith(t, 0)
	for _, c := range []struct {
		name    string
		limit   int64
		stopped bool
	}{
		{"64 MiB guest", 64, true},
		{"control: 512 MiB guest", 512, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			parent := cgroupParent(t)
			spec := shellSpec(t, parent, "hog", hogScript(28))
			spec.Limits.MemoryMiB = c.limit
			stopAtEnd(t, d, spec.ID)
			if _, err := d.Start(t.Context(), spec); err != nil {
				t.Fatal(err)
			}
			limit := memFile(t, spec.CgroupPath, "memory.limit_in_bytes")
			if want := c.limit<<20 + d.overhead; limit != want {
				t.Fatalf("cgroup limit %d, want the guest's %d MiB + %d MiB", limit, c.limit, d.overhead>>20)
			}
			// Wait until the guest reports the memory held or the
			// sandbox is gone.
			var held string
			deadline := time.Now().Add(90 * time.Second)
			for time.Now().Before(deadline) {
				st, err := d.State(t.Context(), spec.ID)
				if err != nil || st.Status != runtime.StatusRunning {
					break
				}
				if out, err := execIn(t.Context(), d, spec.ID, "/bin/cat", "/tmp/held"); err == nil {
					held = strings.TrimSpace(out)
					break
				}
				time.Sleep(200 * time.Millisecond)
			}
			st, serr := d.State(t.Context(), spec.ID)
			kills, _ := cgroups.OOMKills(spec.CgroupPath)
			peak := memFile(t, spec.CgroupPath, "memory.max_usage_in_bytes")
			use := memFile(t, spec.CgroupPath, "memory.usage_in_bytes")
			t.Logf("guest limit %d MiB, cgroup limit %d MiB: allocating 256 MiB: guest said %q; sandbox %v (%v); OOM kills %d; peak %d MiB, now %d MiB",
				c.limit, limit>>20, held, st.Status, serr, kills, peak>>20, use>>20)
			// The kernel may overshoot a limit by its per-CPU charge
			// batches (64 pages each): 1 MiB of slack.
			if peak > limit+1<<20 {
				t.Fatalf("cgroup charged %d, above its limit %d", peak, limit)
			}
			if !c.stopped {
				if held != fmt.Sprintf("held %d", 1<<28) || kills != 0 {
					t.Fatalf("control: the guest did not hold 256 MiB (%q, OOM kills %d)", held, kills)
				}
				return
			}
			if held != "" || kills == 0 || (serr == nil && st.Status == runtime.StatusRunning) {
				t.Fatalf("a 64 MiB guest allocating 256 MiB was not stopped by the OOM killer (said %q, OOM kills %d, sandbox %v)", held, kills, st.Status)
			}
			// The killed sentry's memory goes as it exits.
			for end := time.Now().Add(10 * time.Second); use > d.overhead && time.Now().Before(end); {
				time.Sleep(100 * time.Millisecond)
				use = memFile(t, spec.CgroupPath, "memory.usage_in_bytes")
			}
			t.Logf("the stopped sandbox's cgroup holds %d MiB", use>>20)
			// What is left goes with the stop that follows a dead
			// sandbox (cubelet's destroy): its processes and cgroup.
			dir, _ := memDir(t, spec.CgroupPath)
			if err := d.Stop(t.Context(), spec.ID); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("the stopped sandbox's cgroup %s is still there after Stop: %v", dir, err)
			}
		})
	}
}

// TestCheckpointRefusedWhenFull: a guest holding memory beyond its own
// limit (it may, up to limit plus overhead: this runsc cannot bound it)
// leaves no room for a save, which would OOM-kill the sentry half-way.
// A 64 MiB guest with 64 MiB of overhead (cgroup 128 MiB) writes 100 MiB
// to its tmpfs: the checkpoint is refused with FailedPrecondition naming
// the usage and the limit, and the sandbox runs on untouched. Control:
// the same sandbox, after the guest deleted the files, checkpoints and
// restores in place.
func TestCheckpointRefusedWhenFull(t *testing.T) {
	requireRunsc(t)
	d, parent := driverWith(t, 64<<20), cgroupParent(t)
	spec := shellSpec(t, parent, "full-refused", `head -c 50m /dev/urandom > /dev/shm/fill0; head -c 50m /dev/urandom > /dev/fill1; `+counterScript)
	spec.Limits.MemoryMiB = 64
	stopAtEnd(t, d, spec.ID)
	if _, err := d.Start(t.Context(), spec); err != nil {
		t.Fatal(err)
	}
	st := readState(t, d, spec.ID)
	m, err := readMemory(spec.CgroupPath)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("guest wrote 100 MiB (its limit 64 MiB): the sandbox holds %d MiB of the %d MiB cgroup limit, the guest %d MiB", m.usage>>20, m.limit>>20, m.guest>>20)
	err = d.Checkpoint(t.Context(), spec.ID, filepath.Join(t.TempDir(), "img"), true)
	t.Logf("checkpoint: %v", err)
	if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "would not fit") {
		t.Fatalf("checkpoint of a guest beyond its limit: %v; want FailedPrecondition (the save would not fit)", err)
	}
	st = wantContinued(t, d, spec.ID, st)
	if kills, _ := cgroups.OOMKills(spec.CgroupPath); kills != 0 {
		t.Fatalf("%d OOM kills in the cgroup", kills)
	}

	// Control: the guest frees the memory, the save fits.
	if out, err := execIn(t.Context(), d, spec.ID, "/bin/busybox", "rm", "-f", "/dev/shm/fill0", "/dev/fill1"); err != nil {
		t.Fatalf("rm: %v (%s)", err, out)
	}
	for end := time.Now().Add(10 * time.Second); m.guest+sentryBase+saveReserve > m.limit && time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		if m, err = readMemory(spec.CgroupPath); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("control: guest deleted the files: the sandbox holds %d MiB, the guest %d MiB", m.usage>>20, m.guest>>20)
	if err := d.Checkpoint(t.Context(), spec.ID, filepath.Join(t.TempDir(), "img"), true); err != nil {
		t.Fatalf("control: checkpoint after the guest freed its memory: %v", err)
	}
	wantContinued(t, d, spec.ID, st)
}
