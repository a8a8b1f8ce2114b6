package report

import (
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
