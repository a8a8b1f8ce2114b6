package report

import (
	"fmt"
	"math"
	"slices"
	"time"
)

// Kind says whose code a scenario measures.
type Kind string

const (
	// KindCube scenarios drive cubelet through its gRPC API.
	KindCube Kind = "cube"
	// KindBaseline scenarios time the raw building block a cube scenario
	// is compared with (bare runc, podman, the cgroup freezer), in the
	// same run and on the same rootfs.
	KindBaseline Kind = "baseline"
)

// Params are the size of one run of a scenario.
type Params struct {
	N           int `json:"n"`
	Concurrency int `json:"concurrency"`
}

// KeepErrors is how many failures (and distinct notes of merged chunks)
// a result keeps for the report.
const KeepErrors = 3

// Result is the outcome of one scenario run.
type Result struct {
	Scenario string `json:"scenario"`
	Kind     Kind   `json:"kind"`
	Params   Params `json:"params"`
	// Latency is set for timed scenarios (nanoseconds in JSON).
	Latency *Summary `json:"latency,omitempty"`
	// Failed counts operations that returned an error (not in Latency).
	Failed int `json:"failed,omitempty"`
	// Wall is the duration of the measured phase; N/Wall is throughput.
	Wall time.Duration `json:"wall_ns,omitempty"`
	// Actions breaks a cube scenario's latency down by cubelet's
	// workflow actions (from the timings the RPCs return).
	Actions []ActionStat `json:"actions,omitempty"`
	// Density is set by the density scenario.
	Density *DensityReport `json:"density,omitempty"`
	// Compare holds this scenario against each of its baselines.
	Compare []Comparison `json:"compare,omitempty"`
	// Skipped is why the scenario did not run; Error why it failed.
	Skipped string   `json:"skipped,omitempty"`
	Error   string   `json:"error,omitempty"`
	Notes   []string `json:"notes,omitempty"`
	// Profiles are the files written for this scenario.
	Profiles []string `json:"profiles,omitempty"`
	// Dist is the latency distribution kept for charts (package
	// charts draws CDFs from it): the samples sorted, all of them when
	// there are at most MaxDist, else MaxDist evenly spaced order
	// statistics of them (the first is the minimum, the last the
	// maximum), so the curve keeps its shape at a bounded size.
	Dist []time.Duration `json:"samples_ns,omitempty"`

	// Samples are the raw latencies behind Latency; Acts the raw action
	// timings behind Actions. Neither is reported.
	Samples []time.Duration `json:"-"`
	Acts    *ActionTimes    `json:"-"`
}

// Finish computes what is derived from the raw samples.
func (r *Result) Finish() {
	if r.Acts != nil {
		r.Actions = r.Acts.Stats()
	}
	if len(r.Samples) > 0 {
		r.Dist = Thin(r.Samples, MaxDist)
	}
	if r.Error == "" && r.Latency != nil && r.Latency.N == 0 && r.Failed > 0 {
		r.Error = fmt.Sprintf("all %d operations failed", r.Failed)
	}
}

// Merge joins the chunks of one interleaved scenario into one Result. A
// chunk that failed fails the whole.
func Merge(name string, kind Kind, p Params, parts []*Result) *Result {
	out := &Result{Scenario: name, Kind: kind, Params: p}
	var samples []time.Duration
	acts := &ActionTimes{}
	notes := map[string]bool{}
	for _, r := range parts {
		switch {
		case r.Error != "":
			out.Error = r.Error
			return out
		case r.Skipped != "":
			out.Skipped = r.Skipped
			return out
		}
		samples = append(samples, r.Samples...)
		out.Failed += r.Failed
		out.Wall += r.Wall
		acts.Merge(r.Acts)
		for _, n := range r.Notes {
			if !notes[n] && len(notes) < KeepErrors+1 {
				notes[n] = true
				out.Notes = append(out.Notes, n)
			}
		}
	}
	sum := Summarize(samples)
	out.Latency, out.Samples, out.Acts = &sum, samples, acts
	if len(parts) > 1 {
		out.Notes = append(out.Notes, fmt.Sprintf("measured in %d chunks interleaved with its baselines (--chunks)", len(parts)))
	}
	return out
}

// MaxDist bounds Result.Dist: 200 points draw a CDF no eye tells from
// the full one, and keep results.json small (a create-c50 of 1000
// samples, a density fill of 10,000).
const MaxDist = 200

// Thin returns samples sorted (a copy), cut down to at most k evenly
// spaced order statistics: the i-th of k is the sample of rank
// round(i*(n-1)/(k-1)), so the minimum and maximum stay.
func Thin[T ~int64](samples []T, k int) []T {
	k = max(k, 2)
	s := slices.Clone(samples)
	slices.Sort(s)
	if len(s) <= k {
		return s
	}
	out := make([]T, k)
	for i := range out {
		out[i] = s[ThinRank(i, len(s), k)]
	}
	return out
}

// ThinRank is the rank (0-based, in the sorted sample of n) of the i-th
// of k order statistics Thin keeps; i when n <= k.
func ThinRank(i, n, k int) int {
	k = max(k, 2)
	if n <= k {
		return i
	}
	return int(math.Round(float64(i) * float64(n-1) / float64(k-1)))
}

// Comparison is a cube scenario against one baseline.
type Comparison struct {
	Baseline string `json:"baseline"`
	// RatioAvg and RatioP50 are ours / baseline.
	RatioAvg float64 `json:"ratio_avg,omitempty"`
	RatioP50 float64 `json:"ratio_p50,omitempty"`
	RatioP99 float64 `json:"ratio_p99,omitempty"`
	// DeltaAvg and DeltaP50 are ours - baseline (what cube adds).
	DeltaAvg time.Duration `json:"delta_avg_ns,omitempty"`
	DeltaP50 time.Duration `json:"delta_p50_ns,omitempty"`
	Skipped  string        `json:"skipped,omitempty"`
}

// Timed builds a Result from latency samples.
func Timed(name string, kind Kind, p Params, samples []time.Duration, failed int, wall time.Duration) *Result {
	s := Summarize(samples)
	return &Result{Scenario: name, Kind: kind, Params: p, Latency: &s, Failed: failed, Wall: wall, Samples: samples}
}

// Compare fills a Comparison of ours against base.
func Compare(ours, base *Result) Comparison {
	c := Comparison{Baseline: base.Scenario}
	switch {
	case base.Skipped != "":
		c.Skipped = base.Skipped
		return c
	case base.Error != "":
		c.Skipped = "baseline failed: " + base.Error
		return c
	case ours.Latency == nil || base.Latency == nil || base.Latency.N == 0 || ours.Latency.N == 0:
		c.Skipped = "no samples"
		return c
	}
	o, b := ours.Latency, base.Latency
	ratio := func(x, y time.Duration) float64 {
		if y <= 0 {
			return 0
		}
		return float64(x) / float64(y)
	}
	c.RatioAvg, c.RatioP50, c.RatioP99 = ratio(o.Avg, b.Avg), ratio(o.P50, b.P50), ratio(o.P99, b.P99)
	c.DeltaAvg, c.DeltaP50 = o.Avg-b.Avg, o.P50-b.P50
	return c
}
