package gvisor

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/cgroups"
)

// tightSandbox starts a 64 MiB sandbox (the cluster harness's size)
// whose guest holds a file of CUBE_GVISOR_FILL_MIB MiB (default 24) in
// its tmpfs: with the sentry's own ~40 MiB, about 38 MiB of the 64 are
// charged before any save.
func tightSandbox(t *testing.T, d *Driver, parent, id string) (runtime.Spec, memState) {
	t.Helper()
	fill := 24
	if v, err := strconv.Atoi(os.Getenv("CUBE_GVISOR_FILL_MIB")); err == nil && v > 0 {
		fill = v
	}
	spec := shellSpec(t, parent, id, fmt.Sprintf(`head -c %dm /dev/urandom > /tmp/fill; `, fill)+counterScript)
	spec.Limits.MemoryMiB = 64
	stopAtEnd(t, d, id)
	if _, err := d.Start(t.Context(), spec); err != nil {
		t.Fatalf("Start: %v", err)
	}
	st := readState(t, d, id)
	use, _ := cgroups.MemoryUsage(spec.CgroupPath)
	t.Logf("%s: %d MiB charged of 64 before the checkpoint", id, use>>20)
	return spec, st
}

// TestCheckpointTightMemory: a sandbox near its memory limit is
// checkpointed and restored in place, three times. runsc puts the
// sentry in the sandbox's cgroup, and a save (and a restore) needs memory
// of its own: without room above the limit the kernel OOM-killed the
// sentry mid-save and runsc failed with "EOF", the sandbox lost (what
// failed the cluster drain's moves of 64 MiB gVisor sandboxes under their
// clients' load). The control runs the same sandbox with the driver's
// headroom off: the save is OOM-killed (runsc's EOF, an OOM kill in the
// cgroup), or, when it squeezes through, the restore into the spec's
// limit is ("containerManager.Restore" failed: EOF).
func TestCheckpointTightMemory(t *testing.T) {
	requireRunsc(t)
	d, parent := newTestDriver(t), cgroupParent(t)

	t.Run("control without headroom", func(t *testing.T) {
		ctl := &Driver{bin: d.bin, root: d.root, platform: d.platform, checkpoint: true, log: d.log}
		spec, _ := tightSandbox(t, ctl, parent, "tight-ctl")
		err := ctl.Checkpoint(t.Context(), spec.ID, filepath.Join(t.TempDir(), "img"), true)
		kills, _ := cgroups.OOMKills(spec.CgroupPath)
		t.Logf("without headroom: Checkpoint: %v; OOM kills in the sandbox's cgroup: %d", err, kills)
		// The save or, when the save squeezed through, the restore into
		// the spec's limit dies (runsc's EOF).
		if err == nil || !strings.Contains(err.Error(), "EOF") {
			t.Fatalf("without headroom the save or the restore was expected to be OOM-killed (runsc's EOF): err %v, OOM kills %d", err, kills)
		}
	})

	spec, prev := tightSandbox(t, d, parent, "tight-mem")
	for r := range 3 {
		if err := d.Checkpoint(t.Context(), spec.ID, filepath.Join(t.TempDir(), "img"), true); err != nil {
			kills, _ := cgroups.OOMKills(spec.CgroupPath)
			t.Fatalf("round %d: Checkpoint near the memory limit (OOM kills %d): %v", r, kills, err)
		}
		prev = wantContinued(t, d, spec.ID, prev)
		use, _ := cgroups.MemoryUsage(spec.CgroupPath)
		t.Logf("round %d: checkpointed and restored in place; %d MiB charged now", r, use>>20)
	}
	if kills, _ := cgroups.OOMKills(spec.CgroupPath); kills != 0 {
		t.Fatalf("%d OOM kills in the sandbox's cgroup", kills)
	}
}
