package hostload

import (
	"testing"
	"time"
)

func TestScale(t *testing.T) {
	for _, c := range []struct {
		busy float64
		cpus int
		want time.Duration
	}{
		{0, 2, 5 * time.Second},
		{2, 2, 5 * time.Second},
		{8, 2, 20 * time.Second},
		{3, 2, 7500 * time.Millisecond},
		{8, 0, 5 * time.Second},
	} {
		if got := scale(5*time.Second, c.busy, c.cpus); got != c.want {
			t.Errorf("scale(5s, busy %v, %d CPUs) = %v, want %v", c.busy, c.cpus, got, c.want)
		}
	}
	if r := Runnable(); r < 1 {
		t.Errorf("Runnable() = %d, want at least this thread", r)
	}
	if d := Scale(time.Second); d < time.Second {
		t.Errorf("Scale(1s) = %v, want at least 1s", d)
	}
}
