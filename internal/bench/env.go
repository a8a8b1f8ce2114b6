package bench

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
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

	SnapshotN  int // samples of snapshot, clone-1
	CloneCount int // sandboxes per CloneSandbox call in clone-n

	// NoBaselines skips the raw baselines (ratios are then not reported).
	NoBaselines bool

	// Raw baselines need the same image and agent cubelet was given.
	ImageLayout string // busybox OCI layout (internal/testimage)
	DockerTar   string // the same image as a docker-archive, for podman load
	AgentBinary string // static cube-agent

	// ProfileDir, when set, receives CPU and heap profiles of cubelet per
	// cube scenario (needs Env.PprofURL).
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

// Env is what scenarios run against: a cubelet (its gRPC client and
// whatever the bench knows about its process) and the scratch space for
// raw baselines.
type Env struct {
	RunID    string // labels this run's sandboxes and names its cgroups
	Client   pb.CubeletServiceClient
	Opts     Options
	Progress *Progress
	Log      *slog.Logger
	// WorkDir holds the raw baselines' pool, bundles and podman storage.
	WorkDir string
	// CubeletPID is cubelet's process (0 = unknown: its RSS is then read
	// from /metrics).
	CubeletPID int
	// MetricsURL is cubelet's metrics listener ("http://127.0.0.1:9998"),
	// "" if unknown. Profiles need [api] pprof = true there.
	MetricsURL string

	info *pb.InfoResponse
	node *Node // the private cubelet, when the bench started one

	rawOnce sync.Once
	rawNode *rawNode
	rawErr  error

	podOnce sync.Once
	pod     *podman
	podErr  error

	memoMu sync.Mutex
	memo   map[string][]batch

	warmT warmTemplate // the run's warmed template (warm.go)
	net   *netAgent    // network-agent of a private gvisor/vm node

	profiler *profiler // set by the runner while a scenario runs
}

// Node is the private cubelet the bench started (nil with Setup.Addr).
func (e *Env) Node() *Node { return e.node }

// Info returns the node's info, fetched once.
func (e *Env) Info(ctx context.Context) (*pb.InfoResponse, error) {
	if e.info != nil {
		return e.info, nil
	}
	info, err := e.Client.Info(ctx, &pb.InfoRequest{})
	if err != nil {
		return nil, fmt.Errorf("cubelet info: %w", err)
	}
	e.info = info
	return info, nil
}

// Close releases what baselines set up (their pool, podman storage).
func (e *Env) Close(ctx context.Context) error {
	var errs []error
	if e.Client != nil {
		errs = append(errs, e.warmT.close(ctx, e.Client))
	}
	if e.pod != nil {
		errs = append(errs, e.pod.close(ctx))
	}
	if e.rawNode != nil {
		errs = append(errs, e.rawNode.close(ctx))
	}
	return errors.Join(errs...)
}

// batch is one run's samples (and the action timings behind them).
type batch struct {
	samples []time.Duration
	acts    *actionTimes
}

// remember queues samples that a scenario measured for another one
// (pause and resume come from the same cycles; so do the four pause and
// resume baselines). recall takes the oldest queued batch for key, so
// interleaved chunks pair up in order.
func (e *Env) remember(key string, p Params, b batch) {
	e.memoMu.Lock()
	defer e.memoMu.Unlock()
	if e.memo == nil {
		e.memo = map[string][]batch{}
	}
	k := cacheKey(key, p)
	e.memo[k] = append(e.memo[k], b)
}

func (e *Env) recall(key string, p Params) (batch, bool) {
	e.memoMu.Lock()
	defer e.memoMu.Unlock()
	k := cacheKey(key, p)
	q := e.memo[k]
	if len(q) == 0 {
		return batch{}, false
	}
	e.memo[k] = q[1:]
	return q[0], true
}

// scratch makes a directory under WorkDir.
func (e *Env) scratch(name string) (string, error) {
	d := filepath.Join(e.WorkDir, name)
	if err := os.MkdirAll(d, 0o755); err != nil {
		return "", err
	}
	return d, nil
}

// peak is called by scenarios when what they measure is at its height
// (every sandbox up), so a heap profile shows cubelet's peak.
func (e *Env) peak(ctx context.Context) {
	if e.profiler != nil {
		e.profiler.heap(ctx, "peak")
	}
}
