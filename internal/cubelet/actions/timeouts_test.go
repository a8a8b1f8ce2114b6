package actions

import (
	"testing"
	"time"
)

// TestScaledTimeout: the agent wait grows with the accelerator (TCG) and
// with the waits in flight beyond the CPUs, and is the configured value
// for a lone sandbox on KVM or a container runtime.
func TestScaledTimeout(t *testing.T) {
	const base = 20 * time.Second
	for _, c := range []struct {
		accel         string
		waiting, cpus int
		want          time.Duration
	}{
		{"", 1, 2, base},
		{"kvm", 2, 2, base},
		{"", 8, 2, 4 * base},
		{"tcg", 1, 2, TCGSlowdown * base},
		{"tcg", 8, 2, 4 * TCGSlowdown * base},
		{"tcg", 3, 2, 3 * TCGSlowdown * base / 2},
		{"", 5, 0, base},
	} {
		if got := scaledTimeout(base, c.accel, c.waiting, c.cpus); got != c.want {
			t.Errorf("scaledTimeout(%s, %q, %d waiting, %d CPUs) = %s, want %s", base, c.accel, c.waiting, c.cpus, got, c.want)
		}
	}
}
