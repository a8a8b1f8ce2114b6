package gvisor

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/cubesandbox/cube/internal/runtime/cgroups"
)

// TestCheckpointTightMemory: a sandbox whose memory limit its guest and
// sentry nearly fill (a 64 MiB sandbox, as the cluster's, with a file of
// CUBE_GVISOR_FILL_MIB MiB in its tmpfs) is checkpointed and restored.
func TestCheckpointTightMemory(t *testing.T) {
	requireRunsc(t)
	d, parent := newTestDriver(t), cgroupParent(t)
	fill := 24
	if v, err := strconv.Atoi(os.Getenv("CUBE_GVISOR_FILL_MIB")); err == nil && v > 0 {
		fill = v
	}
	id := "tight-mem"
	spec := shellSpec(t, parent, id, fmt.Sprintf(`head -c %dm /dev/urandom > /tmp/fill; `, fill)+counterScript)
	spec.Limits.MemoryMiB = 64
	stopAtEnd(t, d, id)
	if _, err := d.Start(t.Context(), spec); err != nil {
		t.Fatalf("Start: %v", err)
	}
	prev := readState(t, d, id)
	use, _ := cgroups.MemoryUsage(spec.CgroupPath)
	t.Logf("before the checkpoint: %d MiB charged of 64", use>>20)
	for r := range 3 {
		err := d.Checkpoint(t.Context(), id, filepath.Join(t.TempDir(), "img"), true)
		kills, _ := cgroups.OOMKills(spec.CgroupPath)
		if err != nil {
			t.Fatalf("round %d: Checkpoint with %d MiB charged of 64 (OOM kills %d): %v", r, use>>20, kills, err)
		}
		prev = wantContinued(t, d, id, prev)
		use, _ = cgroups.MemoryUsage(spec.CgroupPath)
		t.Logf("round %d: checkpointed and restored; %d MiB charged now", r, use>>20)
	}
}
