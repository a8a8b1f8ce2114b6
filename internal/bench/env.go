package bench

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/bench/node"
	"github.com/cubesandbox/cube/internal/bench/raw"
	"github.com/cubesandbox/cube/internal/bench/report"
)

// Env is what scenarios run against: a cubelet (its gRPC client and
// whatever the bench knows about its process) and the scratch space for
// raw baselines.
type Env struct {
	RunID    string // labels this run's sandboxes and names its cgroups
	Client   pb.CubeletServiceClient
	Opts     report.Options
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
	// MetricsHTTP reads MetricsURL (with the TLS of --tls-* when set).
	MetricsHTTP *http.Client
	// NetworkAgentPID is network-agent's process when the bench started
	// it as one (--density-net), else 0.
	NetworkAgentPID int

	info *pb.InfoResponse
	node *node.Node // the private cubelet, when the bench started one

	rawOnce sync.Once
	rawNode *raw.Runc
	rawErr  error

	podOnce sync.Once
	pod     *raw.Podman
	podErr  error

	memoMu sync.Mutex
	memo   map[string][]batch

	warmT warmTemplate // the run's warmed template (warm.go)
	poolT poolTemplate // the run's warm pool template (pool.go)
	// poolBurstT is the warm pool template of create-pool-c50.
	poolBurstT poolTemplate
	net        *node.NetAgent // network-agent of a private gvisor/vm node

	profiler *profiler // set by the runner while a scenario runs

	clus benchCluster // the cluster scenarios' cluster (cluster.go)
	e2b  benchE2B     // the E2B scenarios' system (e2b.go)
	// egress is the egress scenarios' system (egress.go).
	egress benchEgress
}

// Node is the private cubelet the bench started (nil with Setup.Addr).
func (e *Env) Node() *node.Node { return e.node }

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
	errs = append(errs, e.clus.close(), e.e2b.close(), e.egress.close())
	if e.Client != nil {
		errs = append(errs, e.warmT.close(ctx, e.Client))
		errs = append(errs, e.closePools(ctx))
	}
	if e.pod != nil {
		errs = append(errs, e.pod.Close(ctx))
	}
	if e.rawNode != nil {
		errs = append(errs, e.rawNode.Close(ctx))
	}
	return errors.Join(errs...)
}

// batch is one run's samples (and the action timings behind them).
type batch struct {
	samples []time.Duration
	acts    *report.ActionTimes
}

func (b batch) result(name string, kind report.Kind, p report.Params) *report.Result {
	r := report.Timed(name, kind, p, b.samples, 0, 0)
	r.Acts = b.acts
	return r
}

// remember queues samples that a scenario measured for another one
// (pause and resume come from the same cycles; so do the four pause and
// resume baselines). recall takes the oldest queued batch for key, so
// interleaved chunks pair up in order.
func (e *Env) remember(key string, p report.Params, b batch) {
	e.memoMu.Lock()
	defer e.memoMu.Unlock()
	if e.memo == nil {
		e.memo = map[string][]batch{}
	}
	k := cacheKey(key, p)
	e.memo[k] = append(e.memo[k], b)
}

func (e *Env) recall(key string, p report.Params) (batch, bool) {
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
