package gvisor

import (
	"errors"
	"fmt"
	"io/fs"
	"strconv"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/cgroups"
)

// DefaultSentryOverhead is the memory a gVisor sandbox's cgroup gets above
// its guest's limit when Config.SentryOverhead is 0 (docs/gvisor.md has
// the measurements it is taken from).
//
// Why: runsc puts the sentry (gVisor's kernel), the gofer and the ptrace
// stubs in the sandbox's cgroup, so the cgroup's limit bounds gVisor's own
// memory together with the guest's. A busybox sandbox's sentry holds
// about 14 MiB, a save about 50 MiB more (the encoder's buffers and
// object tables), and a restored sentry keeps 48-105 MiB whatever its
// guest holds; a 64 MiB sandbox whose guest held part of its limit was
// OOM-killed mid-save (runsc: `containerManager.Checkpoint failed: EOF`)
// and lost. 64 MiB of overhead was too little for a guest that used its
// limit, 96 MiB left no margin, and 128 MiB not always enough: a sandbox
// restored from disk whose sentry kept 105 MiB was OOM-killed in its next
// save. 160 MiB leaves about 50 MiB above the largest restored sentry seen
// (110 MiB) and the guest's 56 MiB.
const DefaultSentryOverhead int64 = 160 << 20

// NoSentryOverhead as Config.SentryOverhead gives the cgroup the guest's
// limit alone (the sentry then competes with its guest for it).
const NoSentryOverhead int64 = -1

// GuestMemoryAnnotation, in a gVisor bundle's config.json, is the guest's
// memory limit in bytes (the runtime.Spec's): linux.resources.memory there
// is that plus the driver's sentry overhead. It is written for whoever
// reads the bundle; the driver never derives a limit from it or from the
// cgroup.
const GuestMemoryAnnotation = "dev.cubesandbox.gvisor.guest-memory-bytes"

// sentryOverhead resolves Config.SentryOverhead: 0 is the default,
// NoSentryOverhead none, anything else below 0 is refused.
func sentryOverhead(v int64) (int64, error) {
	switch {
	case v == 0:
		return DefaultSentryOverhead, nil
	case v == NoSentryOverhead:
		return 0, nil
	case v < 0:
		return 0, fmt.Errorf("gvisor: sentry overhead %d: want >= 0 or NoSentryOverhead: %w", v, errdefs.ErrInvalidArgument)
	}
	return v, nil
}

// MemoryOverhead is the memory this driver gives every sandbox's cgroup
// above its guest's limit (the sentry overhead), in bytes: what a node
// counts on top of each gVisor sandbox's memory limit.
func (d *Driver) MemoryOverhead() int64 { return d.overhead }

// specFor is SpecFor with the sentry overhead added to the memory limit.
// It is the only place a sandbox's cgroup limit is computed: once per
// start or restore, from s.Limits (the spec the sandbox was created
// with), never from the cgroup's limit or its usage, so nothing a
// sandbox does can move its own limit. The limit then holds, unchanged,
// through every checkpoint and restore of that sandbox (a restore in
// place reuses the bundle's config.json as written).
func (d *Driver) specFor(s runtime.Spec) (*specs.Spec, error) {
	sp, err := SpecFor(s)
	if err != nil {
		return nil, err
	}
	addSentryOverhead(sp, s.Limits.MemoryMiB<<20, d.overhead)
	return sp, nil
}

// addSentryOverhead sets sp's memory limit to guest+overhead (memory+swap
// likewise, so swap stays off) and records guest in GuestMemoryAnnotation.
// A spec without a memory limit (guest 0) is left alone: unlimited
// stays unlimited.
func addSentryOverhead(sp *specs.Spec, guest, overhead int64) {
	if guest <= 0 || sp.Linux == nil || sp.Linux.Resources == nil || sp.Linux.Resources.Memory == nil {
		return
	}
	limit := guest + overhead
	m := sp.Linux.Resources.Memory
	m.Limit = &limit
	if m.Swap != nil {
		swap := *m.Swap - guest + limit
		m.Swap = &swap
	}
	if sp.Annotations == nil {
		sp.Annotations = map[string]string{}
	}
	sp.Annotations[GuestMemoryAnnotation] = strconv.FormatInt(guest, 10)
}

// saveReserve is the memory a save needs in the sandbox's cgroup above
// what the sandbox holds: the sentry's encoder buffers and object tables
// took about 50 MiB more than the running sandbox (docs/gvisor.md), with
// a few MiB of margin.
const saveReserve int64 = 56 << 20

// sentryBase is what a freshly started sentry and gofer hold besides their
// guest's memory (about 14 MiB for a busybox sandbox, docs/gvisor.md).
const sentryBase int64 = 16 << 20

// saveFits refuses a checkpoint of the sandbox in bundle whose save would
// not fit in its cgroup: runsc 20221219 cannot bound the guest to its own
// limit, so a guest may hold up to its limit plus the sentry overhead,
// and a save then OOM-kills the sentry half-way and loses the sandbox.
// Refused, the sandbox runs on untouched. It checks only where the driver
// gives an overhead (without one the cgroup was never meant to hold a
// save) and the cgroup has a memory limit.
//
// What is counted is the guest's memory (the cgroup's shmem: the sentry's
// memory file, where gVisor keeps all of it) plus sentryBase, not the
// whole charge: a restored sentry keeps 50-105 MiB of Go heap that its
// next save reuses (saves passed with the charge at 191 of 192 MiB), and
// the image files' page cache is reclaimed under the limit.
func (d *Driver) saveFits(id, bundle string) error {
	if d.overhead <= 0 {
		return nil
	}
	sp, err := readSpec(bundle)
	if err != nil || sp.Linux == nil || sp.Linux.CgroupsPath == "" {
		return nil //nolint:nilerr // no cgroup to read: runsc's checkpoint says what is wrong
	}
	m, err := readMemory(sp.Linux.CgroupsPath)
	if err != nil {
		return fmt.Errorf("gvisor checkpoint %s: %w", id, err)
	}
	if m.limit <= 0 || m.guest+sentryBase+saveReserve <= m.limit {
		return nil
	}
	guest := "its own limit"
	if g, err := strconv.ParseInt(sp.Annotations[GuestMemoryAnnotation], 10, 64); err == nil {
		guest = fmt.Sprintf("its own limit of %d MiB", g>>20)
	}
	return fmt.Errorf("gvisor checkpoint %s: the save would not fit: the sandbox uses %d MiB of its %d MiB cgroup limit, "+
		"its guest %d MiB (beyond %s, which this runsc cannot bound), and a save needs about %d MiB more; "+
		"free memory in the sandbox and retry: %w",
		id, m.usage>>20, m.limit>>20, m.guest>>20, guest, saveReserve>>20, errdefs.ErrFailedPrecondition)
}

// cgroupMemory is a cgroup's memory charge, the guest's part of it
// (shmem) and its limit (0 when none), in bytes.
type cgroupMemory struct{ usage, guest, limit int64 }

// readMemory reads cgroupPath's memory (cgroups.ReadStats: v2's or v1's
// files, whichever hierarchy holds the memory controller); a cgroup found
// in no hierarchy reads as zeros.
func readMemory(cgroupPath string) (cgroupMemory, error) {
	mounts, err := cgroups.Mounts()
	if err != nil {
		return cgroupMemory{}, err
	}
	st, err := cgroups.ReadStats(mounts, cgroupPath)
	if errors.Is(err, fs.ErrNotExist) {
		return cgroupMemory{}, nil
	}
	if err != nil {
		return cgroupMemory{}, err
	}
	return cgroupMemory{usage: st.Memory, guest: st.Shmem, limit: st.MemoryLimit}, nil
}
