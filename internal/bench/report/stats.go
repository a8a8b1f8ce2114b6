package report

import (
	"math"
	"slices"
	"time"
)

// Stats describes a sample: latencies (time.Duration, in ns) or sizes
// (bytes). Percentiles use linear interpolation between closest ranks (the
// R-7 / numpy default), so the P99 of 100 samples is not simply the maximum.
type Stats[T ~int64] struct {
	N   int `json:"n"`
	Min T   `json:"min"`
	Avg T   `json:"avg"`
	Std T   `json:"std"`
	P50 T   `json:"p50"`
	P90 T   `json:"p90"`
	P95 T   `json:"p95"`
	P99 T   `json:"p99"`
	Max T   `json:"max"`
}

// Summary is the Stats of latencies.
type Summary = Stats[time.Duration]

// Summarize computes the stats of samples (which it does not modify). An
// empty sample gives the zero Stats.
func Summarize[T ~int64](samples []T) Stats[T] {
	if len(samples) == 0 {
		return Stats[T]{}
	}
	s := slices.Clone(samples)
	slices.Sort(s)
	var sum float64
	for _, d := range s {
		sum += float64(d)
	}
	mean := sum / float64(len(s))
	var sq float64
	for _, d := range s {
		sq += (float64(d) - mean) * (float64(d) - mean)
	}
	std := 0.0
	if len(s) > 1 {
		// Sample standard deviation: the runs are a sample of what the
		// node would do, not the whole population.
		std = math.Sqrt(sq / float64(len(s)-1))
	}
	return Stats[T]{
		N:   len(s),
		Min: s[0],
		Avg: T(math.Round(mean)),
		Std: T(math.Round(std)),
		P50: Percentile(s, 50),
		P90: Percentile(s, 90),
		P95: Percentile(s, 95),
		P99: Percentile(s, 99),
		Max: s[len(s)-1],
	}
}

// Percentile returns the p-th percentile (0..100) of sorted samples.
func Percentile[T ~int64](sorted []T, p float64) T {
	switch n := len(sorted); {
	case n == 0:
		return 0
	case n == 1 || p <= 0:
		return sorted[0]
	case p >= 100:
		return sorted[n-1]
	}
	rank := p / 100 * float64(len(sorted)-1)
	lo := int(math.Floor(rank))
	frac := rank - float64(lo)
	if lo+1 >= len(sorted) {
		return sorted[lo]
	}
	return sorted[lo] + T(math.Round(frac*float64(sorted[lo+1]-sorted[lo])))
}
