package report

import (
	"errors"
	"fmt"
	"time"
)

// Options are the knobs of a run (cmd/cube-bench maps its flags onto them).
type Options struct {
	Template string // template every cube scenario creates from
	Runtime  string // cubelet runtime; "" = the node default

	N1          int // samples of the concurrency-1 scenarios (create-c1, pause, resume, destroy)
	N50         int // samples of create-c50
	Concurrency int // concurrency of create-c50
	// MaxLive bounds how many sandboxes a create scenario keeps alive:
	// when reached, it stops creating (no timing runs) and destroys them
	// all before going on, so creates never overlap destroys and a large N
	// does not need N sandboxes' worth of memory and loop devices.
	MaxLive int
	// BaselineN caps N of baseline runs (0 = same N as the cube scenario).
	BaselineN int
	// Chunks splits a cube scenario and its baselines into this many
	// alternating runs (1 = baselines first, then the scenario).
	Chunks int

	DensityN           int // idle sandboxes started by the density scenario
	DensityConcurrency int // creates in flight while filling the node
	// DensitySettle is how long density waits once every sandbox is up, so
	// agents finish starting (GC, lazy init) before memory is read.
	DensitySettle time.Duration
	// DensityUse is how many commands (envd process.Start of `true`)
	// each density sandbox runs through the proxy once all are up,
	// before the settle: the figures are then of sandboxes idle after
	// use. 0 leaves them as created.
	DensityUse int
	// DensityNet runs a private node's network-agent as its own process
	// for runc too, so every density sandbox gets a network slot, and
	// reports the agent's RSS.
	DensityNet bool

	SnapshotN  int // samples of snapshot, clone-1
	CloneCount int // sandboxes per CloneSandbox call in clone-n

	// NoBaselines skips the raw baselines (ratios are then not reported).
	NoBaselines bool

	// Raw baselines need the same image and agent cubelet was given.
	ImageLayout string // busybox OCI layout (internal/testimage)
	DockerTar   string // the same image as a docker-archive, for podman load
	AgentBinary string // static cube-agent

	// ProfileDir, when set, receives CPU and heap profiles of cubelet per
	// cube scenario (needs cubelet's metrics address with pprof on).
	ProfileDir    string
	ProfileWindow time.Duration // length of one CPU profile window
}

// DefaultOptions are the anchor's sizes: 100 creates at concurrency 1,
// 1000 at concurrency 50, 1000 idle sandboxes.
func DefaultOptions() Options {
	return Options{
		Template:           "busybox",
		N1:                 100,
		N50:                1000,
		Concurrency:        50,
		MaxLive:            200,
		Chunks:             10,
		DensityN:           1000,
		DensityConcurrency: 8,
		DensitySettle:      3 * time.Second,
		SnapshotN:          20,
		CloneCount:         10,
		ProfileWindow:      2 * time.Second,
	}
}

// Validate rejects sizes a run cannot use.
func (o Options) Validate() error {
	for _, f := range []struct {
		name string
		v    int
	}{
		{"n", o.N1}, {"n-c50", o.N50}, {"concurrency", o.Concurrency}, {"max-live", o.MaxLive},
		{"density-n", o.DensityN}, {"density-concurrency", o.DensityConcurrency},
		{"snapshot-n", o.SnapshotN}, {"clone-count", o.CloneCount}, {"chunks", o.Chunks},
	} {
		if f.v < 1 {
			return fmt.Errorf("--%s %d: must be at least 1", f.name, f.v)
		}
	}
	if o.DensityUse < 0 {
		return fmt.Errorf("--density-use %d: must not be negative", o.DensityUse)
	}
	if o.BaselineN < 0 {
		return fmt.Errorf("--baseline-n %d: must not be negative", o.BaselineN)
	}
	if o.CloneCount > 100 {
		return fmt.Errorf("--clone-count %d: CloneSandbox takes at most 100", o.CloneCount)
	}
	if o.Template == "" {
		return errors.New("--template is empty")
	}
	return nil
}

// SmallDefaults shrinks the sample counts the user did not set for a slow
// runtime (TCG boots take seconds, runsc delete over a second): the
// anchor's 100 creates would take most of an hour. set says which flags
// were given explicitly.
func (o *Options) SmallDefaults(set map[string]bool) {
	if o.Runtime == "" || o.Runtime == "runc" {
		return
	}
	small := map[string]*int{"n": &o.N1, "n-c50": &o.N50, "concurrency": &o.Concurrency, "snapshot-n": &o.SnapshotN,
		"density-n": &o.DensityN, "chunks": &o.Chunks}
	want := map[string]int{"n": 5, "n-c50": 10, "concurrency": 4, "snapshot-n": 5, "density-n": 10, "chunks": 5}
	for name, p := range small {
		if !set[name] {
			*p = want[name]
		}
	}
	if !set["clone-count"] {
		o.CloneCount = 10
		if o.Runtime == "vm" {
			o.CloneCount = 3 // three TCG guests fill two cores
		}
	}
}
