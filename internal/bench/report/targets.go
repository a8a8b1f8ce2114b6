package report

import (
	"fmt"
	"strings"
	"time"
)

// Target is one of the performance targets (docs/bench.md), checked against a report.
type Target struct {
	Name string `json:"name"`
	Want string `json:"want"`
	Got  string `json:"got"`
	// Met is nil when the run did not measure what the target needs.
	Met *bool `json:"met,omitempty"`
}

// DensityTargetN is how many idle sandboxes the density targets are for.
const DensityTargetN = 10000

// CloneTargetN is how many idle VM clones of one warm template the
// density-clones targets are for; CloneOwnTarget what each may own
// beyond its share of the template's pages.
const (
	CloneTargetN   = 1000
	CloneOwnTarget = 16 << 20
)

// cloneTargets judges a vm run's density-clones result (d; nil when the
// run did not measure it). Neither is met by a run that measured nothing.
func cloneTargets(d *Result) []Target {
	n := Target{Name: fmt.Sprintf("idle VM clones of one warm template up, each answering /health through the proxy within 1 s (target N=%d)", CloneTargetN),
		Want: fmt.Sprintf(">= %d", CloneTargetN), Got: "not measured: run density-clones"}
	o := Target{Name: "idle VM clone Pss beyond the template's shared pages", Want: fmt.Sprintf("<= %s (avg)", Bytes(CloneOwnTarget).MiB()), Got: "not measured: run density-clones"}
	if d == nil || d.Density == nil {
		return []Target{n, o}
	}
	met := func(b bool) *bool { return &b }
	dr := d.Density
	if hc := dr.Health; hc != nil {
		healthy := hc.Asked - hc.Failed - hc.Late
		n.Got = fmt.Sprintf("%d up, %d of them answered within %s; host MemAvailable drop %s per clone", dr.Sandboxes, healthy, hc.Within, dr.NodePerSandbox.MiB())
		n.Met = met(hc.Asked == dr.Sandboxes && healthy == hc.Asked && hc.Within <= time.Second && dr.Sandboxes >= CloneTargetN)
	}
	if dr.OwnPSS.N > 0 && dr.Processes > 0 && dr.PSS.Avg > 0 {
		o.Got = fmt.Sprintf("%s avg, %s P99 over %d clones (Pss %s avg)", dr.OwnPSS.Avg.MiB(), dr.OwnPSS.P99.MiB(), dr.Sandboxes, dr.PSS.Avg.MiB())
		o.Met = met(dr.OwnPSS.Avg <= CloneOwnTarget)
	}
	return []Target{n, o}
}

// Evaluate checks the report against the targets. The figures are noisy
// on shared machines; this is what a reader checks first, not a test.
func Evaluate(rep *Report) []Target {
	find := func(name string) *Result {
		for _, r := range rep.Results {
			if r.Scenario == name && r.Skipped == "" && r.Error == "" {
				return r
			}
		}
		return nil
	}
	ms := func(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d)/1e6) }
	met := func(b bool) *bool { return &b }
	var out []Target
	ratio := func(name, want string, limit float64, ours, base string, pick func(*Summary) time.Duration, strict bool) {
		t := Target{Name: name, Want: want, Got: "not measured"}
		o, b := find(ours), find(base)
		if o != nil && b != nil && o.Latency != nil && b.Latency != nil && pick(b.Latency) > 0 {
			r := float64(pick(o.Latency)) / float64(pick(b.Latency))
			t.Got = fmt.Sprintf("%.2fx (%s vs %s)", r, ms(pick(o.Latency)), ms(pick(b.Latency)))
			if strict {
				t.Met = met(r < limit)
			} else {
				t.Met = met(r <= limit)
			}
		}
		out = append(out, t)
	}
	avg := func(s *Summary) time.Duration { return s.Avg }
	ratio("create-to-ready c=1 vs bare runc run -d + first /health", "<= 1.20x (avg)", 1.2, "create-c1", "runc-run", avg, false)
	ratio("create-to-ready c=1 vs podman run", "< 1.00x (avg)", 1.0, "create-c1", "podman-run", avg, true)

	t := Target{Name: "create-to-ready P99 at c=50 vs c=1 median", Want: "<= 3.00x", Got: "not measured"}
	if c50, c1 := find("create-c50"), find("create-c1"); c50 != nil && c1 != nil && c1.Latency.P50 > 0 {
		r := float64(c50.Latency.P99) / float64(c1.Latency.P50)
		t.Got = fmt.Sprintf("%.2fx (P99 %s at c=%d vs P50 %s)", r, ms(c50.Latency.P99), c50.Params.Concurrency, ms(c1.Latency.P50))
		t.Met = met(r <= 3)
	}
	out = append(out, t)

	out = append(out, poolTargets(rep)...)

	delta := func(name, ours, base string) {
		t := Target{Name: name, Want: "<= +1 ms (avg)", Got: "not measured"}
		if o, b := find(ours), find(base); o != nil && b != nil {
			d := o.Latency.Avg - b.Latency.Avg
			t.Got = fmt.Sprintf("%+.2f ms (%s vs %s)", float64(d)/1e6, ms(o.Latency.Avg), ms(b.Latency.Avg))
			t.Met = met(d <= time.Millisecond)
		}
		out = append(out, t)
	}
	delta("pause vs raw freezer write", "pause", "freezer-freeze")
	delta("pause vs bare runc pause", "pause", "runc-pause")
	delta("resume vs raw freezer write", "resume", "freezer-thaw")
	delta("resume vs bare runc resume", "resume", "runc-resume")

	d := find("density")
	// The target is runc's; another runtime's run measures its own.
	rt := "runc"
	if f := strings.Fields(rep.Machine.Runtime); len(f) > 0 {
		rt = f[0]
	}
	t = Target{Name: "host memory per idle " + rt + " sandbox", Want: "<= 3 MiB (avg, agent included)", Got: "not measured"}
	if rt != "runc" {
		t.Want += " for runc" // reported, not judged
	}
	c := Target{Name: "cubelet RSS with the density sandboxes up", Want: "< 300 MiB", Got: "not measured"}
	if d != nil && d.Density != nil {
		dr := d.Density
		t.Got = fmt.Sprintf("%s avg, %s P99 over %d sandboxes", dr.Total.Avg.MiB(), dr.Total.P99.MiB(), dr.Sandboxes)
		if rt == "runc" {
			t.Met = met(dr.Total.Avg <= 3<<20)
		}
		c.Got = fmt.Sprintf("%s with %d sandboxes", dr.CubeletRSS.MiB(), dr.Sandboxes)
		c.Met = met(dr.CubeletRSS < 300<<20)
		if dr.Sandboxes < DensityTargetN {
			t.Name += fmt.Sprintf(" (N=%d, target N=%d)", dr.Sandboxes, DensityTargetN)
			c.Name += fmt.Sprintf(" (N=%d, target N=%d)", dr.Sandboxes, DensityTargetN)
		}
	}
	h := Target{Name: "every idle sandbox answers /health through the proxy", Want: "all within 1 s", Got: "not measured"}
	if d != nil && d.Density != nil && d.Density.Health != nil {
		hc := d.Density.Health
		h.Got = fmt.Sprintf("%d of %d within %s (max %s ms)", hc.Asked-hc.Failed-hc.Late, hc.Asked, hc.Within, fmtMS(hc.Latency.Max))
		h.Met = met(hc.Failed == 0 && hc.Late == 0 && hc.Asked == d.Density.Sandboxes && hc.Within <= time.Second)
		if d.Density.Sandboxes < DensityTargetN {
			h.Name += fmt.Sprintf(" (N=%d, target N=%d)", d.Density.Sandboxes, DensityTargetN)
		}
	}
	out = append(out, t, c, h)
	if rt == "vm" {
		out = append(out, cloneTargets(find("density-clones"))...)
	}
	// Median: with the small N of these runtimes one slow sample moves
	// the average.
	p50 := func(s *Summary) time.Duration { return s.P50 }
	warm := "gVisor / VM create from a warm template snapshot vs bare restore"
	switch {
	case find("runsc-restore") != nil:
		ratio(warm+" (gvisor: runsc restore)", "<= 1.20x (p50)", 1.2, "create-warm", "runsc-restore", p50, false)
	case find("qemu-incoming") != nil:
		ratio(warm+" (vm: qemu -incoming)", "<= 1.20x (p50)", 1.2, "create-warm", "qemu-incoming", p50, false)
	default:
		out = append(out, Target{Name: warm, Want: "<= 1.20x (p50)", Got: "not measured: run with --runtime gvisor or vm"})
	}
	if find("runsc-checkpoint-restore") != nil {
		ratio("gVisor memory snapshot (keeps running) vs bare runsc checkpoint + restore", "<= 1.20x (p50)", 1.2, "snapshot", "runsc-checkpoint-restore", p50, false)
	}
	if find("qemu-incoming-full") != nil {
		ratio("VM create from a shared-memory warm template vs bare qemu -incoming of a full image of it", "<= 0.20x (p50)", 0.2, "create-warm", "qemu-incoming-full", p50, false)
	}
	if find("runsc-restore") != nil && find("create-pool") != nil {
		ratio("gVisor create from a warm pool (frozen entries) vs bare runsc restore of the warm template", "<= 0.25x (p50)", 0.25, "create-pool", "runsc-restore", p50, false)
	}
	if find("qemu-incoming") != nil && find("create-pool") != nil {
		ratio("VM create from a warm pool (paused clones of the warm template) vs bare qemu -incoming of the template", "<= 0.20x (p50)", 0.2, "create-pool", "qemu-incoming", p50, false)
	}
	return out
}

// poolTargets are the warm pool's: create-to-ready from the pool against
// an absolute bound and bare runc, a burst from the pool against the
// pool's c=1 median, a sustained c=50 run whose pool drains against bare
// runc at the same concurrency, and the E2B time to interactive.
func poolTargets(rep *Report) []Target {
	// find picks a result by scenario and concurrency (0: any): runc-run
	// runs at c=1 and at c=50 in one report.
	find := func(name string, c int) *Result {
		for _, r := range rep.Results {
			if r.Scenario == name && r.Skipped == "" && r.Error == "" && r.Latency != nil && r.Latency.N > 0 &&
				(c == 0 || r.Params.Concurrency == c) {
				return r
			}
		}
		return nil
	}
	ms := func(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d)/1e6) }
	met := func(b bool) *bool { return &b }
	var out []Target

	pool, runc1 := find("create-pool", 1), find("runc-run", 1)
	t := Target{Name: "create-to-ready from a warm pool at cubelet", Want: "<= 10 ms (p50)", Got: "not measured"}
	if pool != nil {
		t.Got = ms(pool.Latency.P50)
		t.Met = met(pool.Latency.P50 <= 10*time.Millisecond)
	}
	out = append(out, t)
	t = Target{Name: "create-to-ready from a warm pool vs bare runc run -d + first /health", Want: "<= 0.25x (p50)", Got: "not measured"}
	if pool != nil && runc1 != nil && runc1.Latency.P50 > 0 {
		r := float64(pool.Latency.P50) / float64(runc1.Latency.P50)
		t.Got = fmt.Sprintf("%.2fx (%s vs %s)", r, ms(pool.Latency.P50), ms(runc1.Latency.P50))
		t.Met = met(r <= 0.25)
	}
	out = append(out, t)

	t = Target{Name: "burst from a warm pool: P99 vs the pool's c=1 median", Want: "<= 3.00x", Got: "not measured"}
	if burst := find("create-pool-c50", 0); burst != nil && pool != nil && pool.Latency.P50 > 0 {
		r := float64(burst.Latency.P99) / float64(pool.Latency.P50)
		t.Got = fmt.Sprintf("%.2fx (P99 %s for bursts of %d vs P50 %s)", r, ms(burst.Latency.P99), burst.Params.Concurrency, ms(pool.Latency.P50))
		t.Met = met(r <= 3)
	}
	out = append(out, t)

	sus := find("create-pool-sustained", 0)
	var runcC *Result
	if sus != nil {
		runcC = find("runc-run", sus.Params.Concurrency)
	}
	ops := func(r *Result) float64 {
		if r.Wall <= 0 {
			return 0
		}
		return float64(r.Latency.N) / r.Wall.Seconds()
	}
	tp := Target{Name: "sustained creates, pool drains: throughput vs bare runc run at the same concurrency", Want: ">= 1.00x", Got: "not measured"}
	p99 := Target{Name: "sustained creates, pool drains: P99 vs bare runc run at the same concurrency", Want: "<= 1.00x", Got: "not measured"}
	if sus != nil && runcC != nil && ops(runcC) > 0 && runcC.Latency.P99 > 0 {
		r := ops(sus) / ops(runcC)
		tp.Got = fmt.Sprintf("%.2fx (%.1f vs %.1f creates/s, %d at c=%d)", r, ops(sus), ops(runcC), sus.Latency.N, sus.Params.Concurrency)
		tp.Met = met(r >= 1)
		r = float64(sus.Latency.P99) / float64(runcC.Latency.P99)
		p99.Got = fmt.Sprintf("%.2fx (%s vs %s)", r, ms(sus.Latency.P99), ms(runcC.Latency.P99))
		p99.Met = met(r <= 1)
	}
	out = append(out, tp, p99)

	t = Target{Name: "E2B create + first command from a warm pool (e2b-tti)", Want: "<= 30 ms (p50)", Got: "not measured"}
	if tti := find("e2b-tti", 1); tti != nil {
		t.Got = ms(tti.Latency.P50)
		t.Met = met(tti.Latency.P50 <= 30*time.Millisecond)
	}
	return append(out, t)
}
