package report

import (
	"slices"
	"testing"
	"time"
)

func TestSummarize(t *testing.T) {
	var s []time.Duration
	for i := 100; i >= 1; i-- { // unsorted on purpose
		s = append(s, time.Duration(i)*time.Millisecond)
	}
	got := Summarize(s)
	ms := func(f float64) time.Duration { return time.Duration(f * float64(time.Millisecond)) }
	want := Summary{
		N: 100, Min: ms(1), Max: ms(100), Avg: ms(50.5),
		P50: ms(50.5), P90: ms(90.1), P95: ms(95.05), P99: ms(99.01),
	}
	got.Std = 0
	if got != want {
		t.Fatalf("Summarize = %+v\nwant %+v", got, want)
	}
	if s[0] != 100*time.Millisecond {
		t.Fatal("Summarize sorted its input in place")
	}
	// Sample std of 1..100 is 29.011...
	if std := Summarize(s).Std; std < ms(29.0) || std > ms(29.02) {
		t.Fatalf("std = %v", std)
	}
}

func TestSummarizeSmall(t *testing.T) {
	if (Summarize[time.Duration](nil) != Summary{}) {
		t.Fatal("empty sample should give the zero summary")
	}
	one := Summarize([]time.Duration{7})
	if one.Min != 7 || one.Max != 7 || one.P99 != 7 || one.Std != 0 || one.N != 1 {
		t.Fatalf("one sample: %+v", one)
	}
	two := Summarize([]time.Duration{10, 20})
	if two.P50 != 15 || two.P90 != 19 {
		t.Fatalf("two samples: %+v", two)
	}
}

func TestThin(t *testing.T) {
	var s []time.Duration
	for i := 999; i >= 0; i-- {
		s = append(s, time.Duration(i))
	}
	got := Thin(s, 200)
	if len(got) != 200 || got[0] != 0 || got[199] != 999 || !slices.IsSorted(got) {
		t.Fatalf("Thin(1000, 200): len %d, first %v, last %v", len(got), got[0], got[len(got)-1])
	}
	// The i-th kept value is the sample of rank ThinRank(i): here the
	// samples are their ranks.
	for i, d := range got {
		if int(d) != ThinRank(i, 1000, 200) {
			t.Fatalf("kept[%d] = %v, want rank %d", i, d, ThinRank(i, 1000, 200))
		}
	}
	if s[0] != 999 {
		t.Fatal("Thin sorted its input in place")
	}
	if small := Thin(s[:50], 200); len(small) != 50 || small[0] != 950 || ThinRank(7, 50, 200) != 7 {
		t.Fatalf("Thin of fewer than k: %v", small)
	}
}

func TestFinishKeepsDist(t *testing.T) {
	r := Timed("x", KindCube, Params{N: 3, Concurrency: 1}, []time.Duration{3, 1, 2}, 0, 0)
	r.Finish()
	if !slices.Equal(r.Dist, []time.Duration{1, 2, 3}) {
		t.Fatalf("Dist = %v", r.Dist)
	}
}
