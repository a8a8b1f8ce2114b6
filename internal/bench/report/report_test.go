package report

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

func TestReportAndTargets(t *testing.T) {
	ms := func(f float64) time.Duration { return time.Duration(f * 1e6) }
	lat := func(avg, p50, p99 float64) *Summary {
		return &Summary{N: 10, Min: ms(avg / 2), Avg: ms(avg), P50: ms(p50), P90: ms(p99), P95: ms(p99), P99: ms(p99), Max: ms(p99)}
	}
	c1 := &Result{Scenario: "create-c1", Kind: KindCube, Params: Params{10, 1}, Latency: lat(60, 58, 70)}
	runc := &Result{Scenario: "runc-run", Kind: KindBaseline, Params: Params{10, 1}, Latency: lat(55, 54, 60)}
	pod := &Result{Scenario: "podman-run", Kind: KindBaseline, Params: Params{10, 1}, Latency: lat(200, 190, 250)}
	c1.Compare = []Comparison{Compare(c1, runc), Compare(c1, pod)}
	c50 := &Result{Scenario: "create-c50", Kind: KindCube, Params: Params{10, 50}, Latency: lat(500, 480, 900)}
	pause := &Result{Scenario: "pause", Kind: KindCube, Latency: lat(9, 9, 12)}
	freeze := &Result{Scenario: "freezer-freeze", Kind: KindBaseline, Latency: lat(0.2, 0.2, 0.3)}
	dens := &Result{Scenario: "density", Kind: KindCube, Density: &DensityReport{Sandboxes: 200, Total: Stats[Bytes]{Avg: 6 << 20}, CubeletRSS: 50 << 20}}
	skipped := &Result{Scenario: "snapshot", Kind: KindCube, Skipped: "skipped: cubelet does not implement SnapshotSandbox yet"}
	rep := &Report{RunID: "r1", Command: "cube-bench -n 10", Results: []*Result{runc, pod, c1, c50, freeze, pause, dens, skipped}}
	rep.Targets = Evaluate(rep)

	want := map[string]string{
		"create-to-ready c=1 vs bare runc run -d + first /health": "yes", // 60/55 = 1.09
		"create-to-ready c=1 vs podman run":                       "yes",
		"create-to-ready P99 at c=50 vs c=1 median":               "NO", // 900/58
		"pause vs raw freezer write":                              "NO", // +8.8 ms
		"resume vs raw freezer write":                             "-",
	}
	for _, tg := range rep.Targets {
		w, ok := want[tg.Name]
		if !ok {
			continue
		}
		got := "-"
		if tg.Met != nil {
			got = map[bool]string{true: "yes", false: "NO"}[*tg.Met]
		}
		if got != w {
			t.Errorf("target %q: met %s (%s), want %s", tg.Name, got, tg.Got, w)
		}
		delete(want, tg.Name)
	}
	if len(want) > 0 {
		t.Errorf("targets missing: %v", want)
	}
	if c := c1.Compare[0]; c.RatioAvg < 1.09 || c.RatioAvg > 1.091 || c.DeltaAvg != ms(5) {
		t.Errorf("compare: %+v", c)
	}

	var tab, md, js bytes.Buffer
	if err := WriteTable(&tab, rep); err != nil {
		t.Fatal(err)
	}
	if err := WriteMarkdown(&md, rep); err != nil {
		t.Fatal(err)
	}
	if err := WriteJSON(&js, rep); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"create-c1", "1.09x", "+5.00 ms", "DENSITY: 200 idle sandboxes", "6.00 MiB", "does not implement SnapshotSandbox"} {
		if !strings.Contains(tab.String(), s) {
			t.Errorf("table lacks %q:\n%s", s, tab.String())
		}
	}
	for _, s := range []string{"# cube-bench results", "`cube-bench -n 10`", "| create-c1 | runc-run | 1.09x |", "## Density: 200 idle sandboxes"} {
		if !strings.Contains(md.String(), s) {
			t.Errorf("markdown lacks %q:\n%s", s, md.String())
		}
	}
	if !strings.Contains(js.String(), `"scenario": "create-c1"`) || !strings.Contains(js.String(), `"ratio_avg": 1.09`) {
		t.Errorf("json:\n%s", js.String())
	}
}

func TestOptionsValidate(t *testing.T) {
	if err := DefaultOptions().Validate(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
	for name, mod := range map[string]func(*Options){
		"--n 0":              func(o *Options) { o.N1 = 0 },
		"--concurrency -1":   func(o *Options) { o.Concurrency = -1 },
		"--chunks 0":         func(o *Options) { o.Chunks = 0 },
		"--clone-count 101":  func(o *Options) { o.CloneCount = 101 },
		"--baseline-n -1":    func(o *Options) { o.BaselineN = -1 },
		"--template (empty)": func(o *Options) { o.Template = "" },
	} {
		o := DefaultOptions()
		mod(&o)
		if err := o.Validate(); err == nil {
			t.Errorf("%s accepted", name)
		}
	}
}

func TestSmallDefaults(t *testing.T) {
	o := DefaultOptions()
	o.Runtime = "runc"
	o.SmallDefaults(nil)
	if o.N1 != 100 || o.CloneCount != 10 {
		t.Errorf("runc sizes changed: n=%d clone-count=%d", o.N1, o.CloneCount)
	}
	o = DefaultOptions()
	o.Runtime, o.N1 = "vm", 7
	o.SmallDefaults(map[string]bool{"n": true})
	if o.N1 != 7 || o.SnapshotN != 5 || o.CloneCount != 3 || o.DensityN != 10 {
		t.Errorf("vm sizes: n=%d snapshot-n=%d clone-count=%d density-n=%d", o.N1, o.SnapshotN, o.CloneCount, o.DensityN)
	}
	if err := o.Validate(); err != nil {
		t.Error(err)
	}
}

func TestPoolTargets(t *testing.T) {
	ms := func(f float64) time.Duration { return time.Duration(f * 1e6) }
	res := func(name string, c int, p50, p99 float64, n int, wall time.Duration) *Result {
		return &Result{Scenario: name, Kind: KindCube, Params: Params{n, c}, Wall: wall,
			Latency: &Summary{N: n, Avg: ms(p50), P50: ms(p50), P99: ms(p99), Max: ms(p99)}}
	}
	rep := &Report{Results: []*Result{
		res("runc-run", 1, 40, 60, 100, 4*time.Second),
		res("create-pool", 1, 3, 9, 100, time.Second),
		res("runc-run", 50, 800, 1800, 1000, 20*time.Second),              // 50 creates/s
		res("create-pool-c50", 50, 40, 70, 1000, time.Second),             // 70/3: a miss
		res("create-pool-sustained", 50, 700, 1900, 1000, 19*time.Second), // 52.6/s; P99 over
		res("e2b-tti", 1, 18, 40, 100, 2*time.Second),
	}}
	want := map[string]string{
		"create-to-ready from a warm pool at cubelet":                                         "yes",
		"create-to-ready from a warm pool vs bare runc run -d + first /health":                "yes", // 3/40
		"burst from a warm pool: P99 vs the pool's c=1 median":                                "NO",
		"sustained creates, pool drains: throughput vs bare runc run at the same concurrency": "yes",
		"sustained creates, pool drains: P99 vs bare runc run at the same concurrency":        "NO",
		"E2B create + first command from a warm pool (e2b-tti)":                               "yes",
	}
	for _, tg := range Evaluate(rep) {
		w, ok := want[tg.Name]
		if !ok {
			continue
		}
		got := "-"
		if tg.Met != nil {
			got = map[bool]string{true: "yes", false: "NO"}[*tg.Met]
		}
		if got != w {
			t.Errorf("target %q: met %s (%s), want %s", tg.Name, got, tg.Got, w)
		}
		t.Logf("%s: %s", tg.Name, tg.Got)
		delete(want, tg.Name)
	}
	if len(want) > 0 {
		t.Errorf("targets missing: %v", want)
	}
	// The sustained run is compared with runc-run at its own concurrency,
	// not the c=1 one listed first.
	for _, tg := range Evaluate(rep) {
		if strings.HasPrefix(tg.Name, "sustained creates, pool drains: P99") && !strings.Contains(tg.Got, "1800.0 ms") {
			t.Errorf("sustained P99 compared with the wrong runc-run: %s", tg.Got)
		}
	}
	// Nothing measured: every pool target says so rather than passing.
	for _, tg := range Evaluate(&Report{}) {
		if _, ok := want[tg.Name]; ok && tg.Met != nil {
			t.Errorf("target %q met with nothing measured", tg.Name)
		}
	}
}

func TestCloneTargets(t *testing.T) {
	met := func(tg Target) string {
		if tg.Met == nil {
			return "-"
		}
		return map[bool]string{true: "yes", false: "NO"}[*tg.Met]
	}
	vm := Machine{Runtime: "vm (tcg)"}
	clones := func(n, healthy int, own Bytes) *Result {
		return &Result{Scenario: "density-clones", Kind: KindCube, Density: &DensityReport{
			Sandboxes: n, Processes: n, OwnPSS: Stats[Bytes]{N: n, Avg: own, P99: own}, PSS: Stats[Bytes]{N: n, Avg: own + 5<<20},
			Health: &HealthCheck{Asked: n, Late: n - healthy, Within: time.Second}}}
	}
	for _, c := range []struct {
		name         string
		res          *Result
		wantN, wantM string
	}{
		{"not run", nil, "-", "-"},
		{"few and large", clones(200, 200, 36<<20), "NO", "NO"},
		{"all and small", clones(1000, 1000, 12<<20), "yes", "yes"},
		{"all, some late", clones(1000, 990, 12<<20), "NO", "yes"},
		{"nothing measured", &Result{Scenario: "density-clones", Kind: KindCube, Density: &DensityReport{Sandboxes: 1000}}, "-", "-"},
	} {
		rep := &Report{Machine: vm}
		if c.res != nil {
			rep.Results = []*Result{c.res}
		}
		var got []Target
		for _, tg := range Evaluate(rep) {
			if strings.Contains(tg.Name, "VM clone") {
				got = append(got, tg)
			}
		}
		if len(got) != 2 || met(got[0]) != c.wantN || met(got[1]) != c.wantM {
			t.Errorf("%s: %+v, want met %s, %s", c.name, got, c.wantN, c.wantM)
		}
	}
	// Not a vm run: no clone targets.
	for _, tg := range Evaluate(&Report{Results: []*Result{clones(1000, 1000, 1<<20)}}) {
		if strings.Contains(tg.Name, "VM clone") {
			t.Errorf("runc run judged a clone target: %+v", tg)
		}
	}
}
