package bench

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/bench/raw"
	"github.com/cubesandbox/cube/internal/bench/report"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/leakcheck"
)

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// interrupter passes progress lines on to the test log and cancels the run
// once phase's line shows at least one finished step.
type interrupter struct {
	testWriter
	phase  string
	cancel context.CancelFunc
}

var progressRE = regexp.MustCompile(`^(\S+)\s+\[[#.]*\]\s+(\d+)/\d+`)

func (w *interrupter) Write(p []byte) (int, error) {
	if m := progressRE.FindSubmatch(p); len(m) == 3 && string(m[1]) == w.phase && string(m[2]) != "0" {
		w.cancel()
	}
	return w.testWriter.Write(p)
}

// TestScenariosTiny runs every scenario and baseline with tiny N against
// a private cubelet, checks what each reports, and that neither the
// scenarios nor the run's cleanup leave anything on the host. The first
// create is made to fail (a failpoint in cubelet's create flow) to check
// that failures are counted, not timed, and leak nothing.
func TestScenariosTiny(t *testing.T) {
	cubelettest.RequireRoot(t)
	t.Setenv("CUBE_FAILPOINTS", "create/agent=1*error(injected by cube-bench test)")
	bin := cubelettest.Binaries(t)
	o := report.DefaultOptions()
	o.N1, o.N50, o.Concurrency, o.MaxLive = 3, 3, 2, 2 // create-c50: two rounds
	o.DensityN, o.DensityConcurrency, o.DensitySettle, o.DensityUse = 3, 3, 100*time.Millisecond, 2
	o.SnapshotN, o.CloneCount = 2, 2
	o.ProfileDir, o.ProfileWindow = t.TempDir(), time.Second
	runID := NewRunID()
	work := filepath.Join(os.TempDir(), "cube-bench-test-"+runID)
	ctx := context.Background()
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

	list, err := Resolve([]string{"all"})
	if err != nil {
		t.Fatal(err)
	}
	rep := Run(ctx, e, list)
	var tab strings.Builder
	if err := report.WriteTable(&tab, rep); err != nil {
		t.Fatal(err)
	}
	t.Log("\n" + tab.String())

	// Scenarios clean up after themselves: check before the run's cleanup
	// (the warm pools, kept for the run, are drained first).
	if err := e.closePools(ctx); err != nil {
		t.Fatal(err)
	}
	leakcheck.AssertNone(t, ctx, e.Node().Scope())
	if e.rawNode != nil {
		leakcheck.AssertNone(t, ctx, e.rawNode.Scope())
	}

	byName := map[string]*report.Result{}
	for _, r := range rep.Results {
		byName[r.Scenario] = r
	}
	mustRun := []string{"create-c1", "create-c50", "pause", "resume", "destroy", "density", "restart",
		"runc-run", "runc-pause", "runc-resume", "freezer-freeze", "freezer-thaw", "runc-delete"}
	if _, err := exec.LookPath("podman"); err == nil {
		mustRun = append(mustRun, "podman-run")
	}
	for _, name := range mustRun {
		r := byName[name]
		switch {
		case r == nil:
			t.Errorf("%s: no result", name)
		case r.Error != "" || r.Skipped != "":
			t.Errorf("%s: error %q, skipped %q", name, r.Error, r.Skipped)
		case name != "density" && (r.Latency == nil || r.Latency.Min <= 0 || r.Latency.Max < r.Latency.P99):
			t.Errorf("%s: bad latency %+v", name, r.Latency)
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	if c1 := byName["create-c1"]; c1.Failed != 1 || c1.Latency.N != 2 || len(c1.Notes) == 0 || !strings.Contains(c1.Notes[0], "injected") {
		t.Errorf("create-c1 with one injected failure: failed=%d n=%d notes=%q", c1.Failed, c1.Latency.N, c1.Notes)
	}
	if c50 := byName["create-c50"]; c50.Latency.N != 3 || c50.Params.Concurrency != 2 {
		t.Errorf("create-c50: %+v", c50)
	}
	for _, name := range []string{"pause", "resume", "destroy", "runc-pause", "freezer-thaw"} {
		if n := byName[name].Latency.N; n != 3 {
			t.Errorf("%s: %d samples, want 3", name, n)
		}
	}
	wantCompare := map[string][]string{
		"create-c1": {"runc-run"}, "create-c50": {"runc-run"}, "pause": {"runc-pause", "freezer-freeze"},
		"resume": {"runc-resume", "freezer-thaw"}, "destroy": {"runc-delete"},
	}
	for name, bases := range wantCompare {
		got := map[string]report.Comparison{}
		for _, c := range byName[name].Compare {
			got[c.Baseline] = c
		}
		for _, b := range bases {
			if c, ok := got[b]; !ok || c.RatioAvg <= 0 || c.Skipped != "" {
				t.Errorf("%s vs %s: %+v", name, b, c)
			}
		}
		if _, ok := got["runsc-restore"]; ok {
			t.Errorf("%s compared with a gVisor baseline on a runc run", name)
		}
	}
	d := byName["density"].Density
	if d == nil || d.Sandboxes != 3 || d.Processes < 3 || d.Total.Min <= 0 || d.PSS.Min <= 0 || d.Charged.Min <= 0 || d.CubeletRSS <= 0 {
		t.Errorf("density: %+v", d)
	}
	// Three sandboxes fill in three parts: two unsettled growth points
	// and the settled one, which repeats the report's figures.
	if d != nil && (len(d.Growth) != 3 || d.Growth[0].Sandboxes != 1 || d.Growth[1].Sandboxes != 2 || d.Growth[0].Total <= 0 ||
		d.Growth[0].CubeletRSS <= 0 || !d.Growth[2].Settled || d.Growth[2].Total != d.Total.Avg || d.Growth[2].Measured != 3) {
		t.Errorf("density growth: %+v", d.Growth)
	}
	// Each ran its commands through the proxy first (a failure fails the
	// scenario), and the report says the figures are of used sandboxes.
	if r := byName["density"]; !slices.ContainsFunc(r.Notes, func(n string) bool { return strings.Contains(n, "ran `true` 2 times") }) {
		t.Errorf("density notes: %q, want the commands run in each sandbox", r.Notes)
	}
	// Each of them answered /health through the proxy.
	if d != nil && (d.Health == nil || d.Health.Asked != 3 || d.Health.Failed != 0 || d.Health.Late != 0 || d.Health.Latency.Min <= 0) {
		t.Errorf("density /health through the proxy: %+v", d.Health)
	}
	// Every timed result keeps its samples (sorted) for the charts.
	for _, name := range []string{"create-c1", "runc-run", "pause"} {
		if r := byName[name]; len(r.Dist) != r.Latency.N || !slices.IsSorted(r.Dist) || r.Dist[0] != r.Latency.Min {
			t.Errorf("%s: kept distribution %v for %+v", name, r.Dist, r.Latency)
		}
	}
	// Snapshots, clones and the E2B round trip run where the node has
	// them and are skipped with a reason otherwise: never a silent gap.
	for _, name := range []string{"snapshot", "clone-1", "clone-n", "e2b", "e2b-tti", "e2b-tti-burst", "e2b-tti-cold", "create-warm", "pause-disk", "resume-disk", "create-pool-sustained"} {
		r := byName[name]
		if r == nil || (r.Skipped == "" && r.Error == "" && r.Latency == nil) || r.Error != "" {
			t.Errorf("%s: %+v", name, r)
		}
	}
	// The E2B creates came from the node's warm pool, except the cold
	// scenario's (a create served otherwise fails the sample).
	for name, want := range map[string]string{"e2b": "3 of 3", "e2b-tti": "3 of 3", "e2b-tti-burst": "3 of 3", "e2b-tti-cold": "0 of 3"} {
		if r := byName[name]; r != nil && r.Latency != nil && !slices.Contains(r.Notes, "creates served from the warm pool: "+want) {
			t.Errorf("%s: no note that %s creates came from the warm pool: %q", name, want, r.Notes)
		}
	}
	if p := byName["create-c1"].Profiles; len(p) < 2 || !hasFile(p, "cpu-000.pb.gz") || !hasFile(p, "heap-end.pb.gz") {
		t.Errorf("create-c1 profiles: %v", p)
	}
	if len(rep.Targets) == 0 || rep.Targets[0].Met == nil {
		t.Errorf("targets not evaluated: %+v", rep.Targets)
	}

	// An interrupted run (Ctrl-C) stops mid-phase and still removes what
	// it made: once inside a baseline, once inside a cube scenario. The
	// interrupt comes when the phase's progress line first shows finished
	// steps (a tenth of 32), so it lands mid-phase however fast the machine.
	c50, _ := Lookup("create-c50")
	e.Opts.N50, e.Opts.Concurrency, e.Opts.MaxLive, e.Opts.ProfileDir = 32, 4, 32, ""
	prog := e.Progress
	for _, noBase := range []bool{false, true} {
		e.Opts.NoBaselines = noBase
		cctx, cancel := context.WithCancel(ctx)
		phase := "runc-run"
		if noBase {
			phase = "create-c50"
		}
		e.Progress = NewProgress(&interrupter{testWriter: testWriter{t}, phase: phase, cancel: cancel})
		irep := Run(cctx, e, []*Scenario{c50})
		cancel()
		if cctx.Err() == nil {
			t.Fatalf("phase %s never showed progress", phase)
		}
		if len(irep.Results) == 0 {
			t.Errorf("interrupted run (no baselines: %v) ran nothing", noBase)
		}
		for _, r := range irep.Results {
			// Baseline chunks that finished before the interrupt stand.
			t.Logf("interrupted %s: %s", r.Scenario, r.Error)
			if r.Kind == report.KindCube && r.Error == "" {
				t.Errorf("interrupted run (no baselines: %v): %s has no error: %+v", noBase, r.Scenario, r)
			}
		}
		leakcheck.AssertNone(t, ctx, e.Node().Scope())
		leakcheck.AssertNone(t, ctx, e.rawNode.Scope())
	}
	e.Progress = prog

	// --addr: drive the same cubelet as an already running one; its RSS
	// then comes from /metrics.
	ae, acleanup, err := Prepare(ctx, Setup{
		Addr: e.Node().Socket, MetricsAddr: strings.TrimPrefix(e.Node().MetricsURL, "http://"),
		BinDir: bin, WorkDir: work + "-addr", Opts: o,
	})
	if err != nil {
		t.Fatal(err)
	}
	ae.Opts.NoBaselines, ae.Opts.DensityN, ae.Opts.N1 = true, 1, 1
	dens, _ := Lookup("density")
	c1, _ := Lookup("create-c1")
	arep := Run(ctx, ae, []*Scenario{c1, dens})
	if err := acleanup(ctx); err != nil {
		t.Errorf("--addr cleanup: %v", err)
	}
	if len(arep.Results) != 2 || arep.Results[0].Error != "" || arep.Results[1].Density == nil || arep.Results[1].Density.CubeletRSS <= 0 {
		t.Errorf("--addr run: %+v", arep.Results)
	}
	leakcheck.AssertNone(t, ctx, e.Node().Scope())

	rawScope := e.rawNode.Scope()
	podParent := ""
	if e.pod != nil {
		podParent = strings.TrimPrefix(e.pod.CgroupParent(), "/")
	}
	cleaned = true
	if err := cleanup(ctx); err != nil {
		t.Fatalf("cleanup: %v", err)
	}
	if _, err := os.Stat(work); !os.IsNotExist(err) {
		t.Errorf("work dir %s still there: %v", work, err)
	}
	// Nothing of the run may survive: pools unmounted, their loop
	// devices gone, every cgroup parent removed.
	for _, s := range []leakcheck.Scope{e.Node().Scope(), rawScope, {DataDir: work, RunDir: work, CgroupName: podParent}} {
		s.AllowMounts, s.AllowLoopBacking = nil, nil
		leakcheck.AssertNone(t, ctx, s)
	}
	ms, _ := raw.CgroupMounts()
	for _, m := range ms {
		for _, p := range []string{e.Node().CgroupParent, rawScope.CgroupName, podParent} {
			if p == "" {
				continue
			}
			if _, err := os.Stat(filepath.Join(m.Dir, p)); err == nil {
				t.Errorf("cgroup %s left in %s", p, m.Dir)
			}
		}
	}
}

func hasFile(files []string, base string) bool {
	for _, f := range files {
		if filepath.Base(f) == base {
			return true
		}
	}
	return false
}
