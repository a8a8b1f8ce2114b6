package cubelet

import (
	"testing"

	"github.com/cubesandbox/cube/internal/runtime/gvisor"
	"github.com/cubesandbox/cube/internal/runtime/runc"
	"github.com/cubesandbox/cube/internal/testenv"
)

var _ memoryOverhead = (*gvisor.Driver)(nil)

// TestOverheadMiB: a gVisor sandbox counts its sentry overhead in the
// node's allocated memory (rounded up to MiB); a runc sandbox counts its
// limit alone.
func TestOverheadMiB(t *testing.T) {
	testenv.RequireBinary(t, "runsc", "runsc")
	for _, c := range []struct {
		cfg  int64
		want int64
	}{{0, gvisor.DefaultSentryOverhead >> 20}, {gvisor.NoSentryOverhead, 0}, {32<<20 + 1, 33}} {
		d, err := gvisor.New(gvisor.Config{Root: t.TempDir(), SentryOverhead: c.cfg})
		if err != nil {
			t.Fatal(err)
		}
		if got := overheadMiB(d); got != c.want {
			t.Errorf("gvisor with SentryOverhead %d: %d MiB, want %d", c.cfg, got, c.want)
		}
	}
	// The runc driver has no overhead (its type says so; no driver
	// needs to run for that).
	var r *runc.Driver
	if got := overheadMiB(r); got != 0 {
		t.Errorf("runc: %d MiB, want 0", got)
	}
	if got := overheadMiB(nil); got != 0 {
		t.Errorf("no driver: %d MiB, want 0", got)
	}
}
