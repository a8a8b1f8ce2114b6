package bench

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/bench/raw"
	"github.com/cubesandbox/cube/internal/bench/report"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/leakcheck"
	"github.com/cubesandbox/cube/internal/runtime/vm"
)

func TestCheckRuntime(t *testing.T) {
	for _, rt := range KnownRuntimes {
		if err := CheckRuntime(rt); err != nil {
			t.Errorf("%s: %v", rt, err)
		}
	}
	if err := CheckRuntime("kata"); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "kata") {
		t.Errorf("kata: %v", err)
	}
}

// TestRuntimeScenariosTiny runs the warm-template, pause-to-disk and
// snapshot scenarios with their raw restore baselines on gvisor and vm
// (each where this host has it) against a private node with its own
// network-agent, and checks that scenarios, baselines (also a failing raw
// restore) and the run's cleanup leave nothing behind.
func TestRuntimeScenariosTiny(t *testing.T) {
	cubelettest.RequireRoot(t)
	bin := cubelettest.Binaries(t)
	for _, tc := range []struct{ rt, bin, raw string }{
		{"gvisor", "runsc", "runsc-restore"},
		{"vm", "qemu-system-x86_64", "qemu-incoming"},
	} {
		t.Run(tc.rt, func(t *testing.T) {
			if _, err := exec.LookPath(tc.bin); err != nil {
				t.Skipf("%s not installed", tc.bin)
			}
			ctx := context.Background()
			o := report.DefaultOptions()
			o.Runtime = tc.rt
			o.SmallDefaults(nil)
			o.N1, o.SnapshotN, o.Chunks, o.DensityN = 2, 1, 2, 2
			runID := NewRunID()
			work := filepath.Join(os.TempDir(), "cube-bench-test-"+runID)
			e, cleanup, err := Prepare(ctx, Setup{RunID: runID, BinDir: bin, WorkDir: work, Opts: o, Progress: NewProgress(testWriter{t})})
			if err != nil {
				t.Fatal(err)
			}
			cleaned := false
			t.Cleanup(func() {
				if !cleaned {
					_ = cleanup(ctx)
				}
			})
			list, err := Resolve([]string{"create-warm", "pause-disk", "resume-disk", "snapshot", "density-clones"})
			if err != nil {
				t.Fatal(err)
			}
			rep := Run(ctx, e, list)
			var tab strings.Builder
			if err := report.WriteTable(&tab, rep); err != nil {
				t.Fatal(err)
			}
			t.Log("\n" + tab.String())
			byName := map[string]*report.Result{}
			for _, r := range rep.Results {
				byName[r.Scenario] = r
			}
			for _, name := range []string{"create-warm", "pause-disk", "resume-disk", "snapshot", tc.raw} {
				r := byName[name]
				if r == nil || r.Error != "" || r.Skipped != "" || r.Failed > 0 || r.Latency == nil || r.Latency.Min <= 0 {
					t.Errorf("%s: %+v", name, r)
				}
			}
			// density-clones: clones of the warm template, each measured
			// and asked /health through the proxy.
			if r := byName["density-clones"]; r == nil || r.Error != "" || r.Skipped != "" || r.Density == nil {
				t.Errorf("density-clones: %+v", r)
			} else if d := r.Density; d.Sandboxes != 2 || d.PSS.Min <= 0 || d.OwnPSS.Min <= 0 || d.OwnPSS.Max > d.PSS.Max ||
				d.Health == nil || d.Health.Asked != 2 || d.Health.Failed != 0 {
				t.Errorf("density-clones: %+v", d)
			}
			// vm: also qemu-incoming-full, the full image of the same
			// (shared-memory) warm snapshot.
			wantCmp := []string{tc.raw}
			if tc.rt == "vm" {
				wantCmp = append(wantCmp, "qemu-incoming-full")
				if r := byName["qemu-incoming-full"]; r == nil || r.Error != "" || r.Skipped != "" || r.Failed > 0 {
					t.Errorf("qemu-incoming-full: %+v", r)
				}
			}
			if c := byName["create-warm"]; c != nil {
				if len(c.Compare) != len(wantCmp) {
					t.Errorf("create-warm compared with %+v, want %v", c.Compare, wantCmp)
				}
				for i, cmp := range c.Compare {
					if i >= len(wantCmp) || cmp.Baseline != wantCmp[i] || cmp.RatioAvg <= 0 {
						t.Errorf("create-warm compared with %+v, want %v", c.Compare, wantCmp)
					}
				}
			}
			target := func(prefix string) *report.Target {
				for i := range rep.Targets {
					if strings.HasPrefix(rep.Targets[i].Name, prefix) {
						return &rep.Targets[i]
					}
				}
				return nil
			}
			if w := target("gVisor / VM create from a warm template"); w == nil || w.Met == nil || !strings.Contains(w.Name, tc.raw[:4]) {
				t.Errorf("warm target not evaluated: %+v", w)
			}
			if c := target("idle VM clone Pss"); (c != nil && c.Met != nil) != (tc.rt == "vm") {
				t.Errorf("idle VM clone target on %s: %+v", tc.rt, c)
			}
			// gvisor: the live snapshot against the bare checkpoint +
			// restore, whose sandboxes (two runsc IDs each) cubelet's
			// delete removes (the leak check below).
			if tc.rt == "gvisor" {
				r := byName["runsc-checkpoint-restore"]
				if r == nil || r.Error != "" || r.Skipped != "" || r.Failed > 0 || r.Latency == nil || r.Latency.Min <= 0 {
					t.Errorf("runsc-checkpoint-restore: %+v", r)
				}
				if s := target("gVisor memory snapshot"); s == nil || s.Met == nil {
					t.Errorf("snapshot target not evaluated: %+v", s)
				}
			}

			if tc.rt == "vm" {
				rawIncomingFailureLeaksNothing(t, e)
			}
			// Scenarios clean up after themselves (the warm template stays
			// until the run's cleanup).
			leakcheck.AssertNone(t, ctx, e.Node().Scope())
			netScope := e.net.Scope()
			nodeScope := e.Node().Scope()
			cleaned = true
			if err := cleanup(ctx); err != nil {
				t.Fatalf("cleanup: %v", err)
			}
			nodeScope.AllowMounts, nodeScope.AllowLoopBacking = nil, nil
			leakcheck.AssertNone(t, ctx, nodeScope)
			leakcheck.AssertNone(t, ctx, netScope)
			if _, err := os.Stat(work); !os.IsNotExist(err) {
				t.Errorf("work dir %s still there: %v", work, err)
			}
			if pids := qemusUnder(work); len(pids) > 0 {
				t.Errorf("QEMU processes left: %v", pids)
			}
		})
	}
}

// rawIncomingFailureLeaksNothing feeds the raw VM restore a truncated
// memory image: it must fail, and leave neither QEMU nor files.
func rawIncomingFailureLeaksNothing(t *testing.T, e *Env) {
	ctx := context.Background()
	mem, disk, err := e.warmSnapshotFiles(ctx)
	if err != nil {
		t.Fatal(err)
	}
	bad := filepath.Join(e.node.DataDir, "pool", "bench-bad")
	if err := os.MkdirAll(bad, 0o755); err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(bad)
	for _, f := range []string{vm.ShapeFile, vm.MemoryFile} {
		b, err := os.ReadFile(filepath.Join(mem, f))
		if err != nil {
			t.Fatal(err)
		}
		if f == vm.MemoryFile {
			b = b[:len(b)/3]
		}
		if err := os.WriteFile(filepath.Join(bad, f), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	// Without a shared-memory template's RAM file: QEMU 7.2 given a
	// device stream cut short may wait for the rest for ever (the raw
	// restore would then end at its timeout); the driver's own restore
	// of one is TestTemplateSharedMemory's.
	work := filepath.Join(bad, "work")
	if _, err := raw.Incoming(ctx, bad, disk, work, 2000); err == nil {
		t.Fatal("raw restore of a truncated image succeeded")
	} else {
		t.Logf("truncated image: %v", err)
	}
	if pids := qemusUnder(bad); len(pids) > 0 {
		t.Errorf("failed raw restore left QEMU %v", pids)
	}
}

// qemusUnder lists QEMU processes whose command line names a path under dir.
func qemusUnder(dir string) []string {
	var out []string
	ents, _ := os.ReadDir("/proc")
	for _, ent := range ents {
		b, err := os.ReadFile(filepath.Join("/proc", ent.Name(), "cmdline"))
		if err != nil || !raw.IsQemu(b) {
			continue
		}
		if strings.Contains(string(b), dir) {
			out = append(out, ent.Name())
		}
	}
	return out
}
