// Package cubelet is the node daemon: it owns every sandbox on its node end
// to end. Service is the in-process API; the gRPC server in package
// cubeletapi is a thin adapter over it, so the CLI's tests and the e2e
// suites can drive the same object.
//
// Concurrency: one lock per sandbox (held for the whole of a flow); readers
// never take it. Different sandboxes never wait on each other: the only
// shared lock (s.mu) guards the map of sandboxes and is held for map
// operations only.
package cubelet

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/cubesandbox/cube/internal/cubelet/actions"
	"github.com/cubesandbox/cube/internal/cubelet/config"
	"github.com/cubesandbox/cube/internal/cubelet/health"
	"github.com/cubesandbox/cube/internal/cubelet/masterlink"
	"github.com/cubesandbox/cube/internal/cubelet/usage"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/objstore"
	"github.com/cubesandbox/cube/internal/runtime/cgroups"
	"github.com/cubesandbox/cube/internal/store"
	"github.com/cubesandbox/cube/internal/workflow"
)

// Service is one node's cubelet.
type Service struct {
	// dataAddr is where the node data listener is bound (SetDataAddress).
	dataAddr atomic.Pointer[string]
	cfg      *config.Config
	log      *slog.Logger
	store    *store.Store
	engine   *workflow.Engine[*actions.Task]
	node     *actions.Node
	metrics  *prometheus.Registry

	mu    sync.Mutex
	boxes map[string]*entry // by sandbox ID; every record in the store has one

	tmplMu    sync.Mutex
	importing map[string]bool // template IDs being imported
	// unusedSince is when template GC first saw each template unused.
	unusedSince map[string]time.Time

	snaps snapRefs // in-flight users of snapshots (snapshots.go)

	// The object store snapshots travel through (shipping.go), opened on
	// first use, and the memory fingerprints by runtime.
	objMu  sync.Mutex
	obj    *objstore.Store
	compat map[string]map[string]string

	// stop cancels the lifetime context the GC loop runs under (Close).
	stop context.CancelFunc
	// closeOnce makes Close idempotent (tests and the daemon may both call it).
	closeOnce sync.Once
	gcDone    chan struct{}
	kick      chan struct{}    // wakes the GC loop early
	hb        *masterlink.Link // nil when no master is configured

	// life is the service's lifetime context (Close cancels it).
	life  context.Context
	watch deathWatch // the runtime watch (watch.go)
	// health keeps each condition's run of failed probes (health.go);
	// healthDone closes when its probe loop has stopped.
	health     *health.Tracker
	healthDone chan struct{}
	// usage samples every sandbox's resource use (usage.go); usageDone
	// closes when its loop has stopped.
	usage     *usage.Sampler
	usageDone chan struct{}
	// pool is the warm pools (warmpool.go); nil when none is configured.
	pool *warmPool
}

// New opens the store, runs the init flow, reconciles the store with what
// really exists on the node, and starts the cleanup loop. The caller
// serves the API afterwards.
func New(ctx context.Context, cfg *config.Config, log *slog.Logger) (*Service, error) {
	if log == nil {
		log = slog.Default()
	}
	for _, d := range []string{cfg.Node.DataDir, cfg.Node.RunDir} {
		if err := os.MkdirAll(d, 0o711); err != nil {
			return nil, err
		}
	}
	// Sandbox bundles and root filesystems are root's alone: a rootfs is
	// the tenant's files and whatever setuid binary or device node its
	// root planted, which another host account must not reach. Chmod
	// also tightens a directory an older cubelet made.
	sandboxes := filepath.Join(cfg.Node.RunDir, "sandboxes")
	if err := os.MkdirAll(sandboxes, 0o700); err != nil {
		return nil, err
	}
	if err := os.Chmod(sandboxes, 0o700); err != nil {
		return nil, err
	}
	st, err := store.Open(cfg.StorePath(), store.WithLogger(log))
	if err != nil {
		return nil, err
	}
	s := &Service{
		cfg:        cfg,
		log:        log,
		store:      st,
		node:       actions.NewNode(cfg),
		metrics:    prometheus.NewRegistry(),
		boxes:      map[string]*entry{},
		importing:  map[string]bool{},
		gcDone:     make(chan struct{}),
		health:     health.New(healthThreshold),
		healthDone: make(chan struct{}),
		kick:       make(chan struct{}, 1),
		usageDone:  make(chan struct{}),
	}
	s.usage = s.newSampler()
	// The service's lifetime: New's ctx bounds only the start-up (it may be
	// a request's or a timeout's); Close ends this one.
	life, stop := context.WithCancel(context.WithoutCancel(ctx))
	s.stop, s.life = stop, life
	ok := false
	defer func() {
		if !ok {
			stop()
			s.stopWatch()
			s.hb.Stop()
			s.stopStorage() // the disk pool's refiller, if it started
			st.Close()
		}
	}()
	s.metrics.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), &stateCollector{s: s}, s.usage.Collector())

	reg := workflow.NewRegistry()
	actions.Register(s.node, reg)
	s.engine, err = workflow.New(reg, actions.Verbs(), cfg.Flows,
		workflow.WithMetrics(s.metrics, "cubelet"),
		workflow.WithLogger(log),
		workflow.WithFailpoints(true),
		workflow.WithErrorWrap(s.noSpace))
	if err != nil {
		return nil, err
	}
	// The link exists before reconcile (the runtime watch it arms may
	// kick it); it registers only once the API listens (Serving).
	masterTLS, err := cfg.TLS.Client("tls")
	if err != nil {
		return nil, err
	}
	if s.hb, err = masterlink.New(cfg.Master, masterTLS, s.NodeReport, log); err != nil {
		return nil, fmt.Errorf("master: %w", err)
	}
	if _, err := s.engine.Run(ctx, FlowInit, nil); err != nil {
		return nil, fmt.Errorf("init flow: %w", err)
	}
	if err := s.reconcile(ctx); err != nil {
		return nil, fmt.Errorf("reconcile: %w", err)
	}
	if err := s.startStorage(ctx); err != nil {
		return nil, fmt.Errorf("storage: %w", err)
	}
	s.armAll()
	if cfg.WarmPool.On() || len(s.poolEntries("")) > 0 {
		s.startPool(life)
	}
	s.probe(ctx)
	go s.gcLoop(life)
	go s.healthLoop(life)
	go func() { defer close(s.usageDone); s.usage.Run(life) }()
	ok = true
	return s, nil
}

// Serving tells the service its API listens: the node registers with
// the master now (not earlier, or the master would place sandboxes on a
// node it cannot reach yet).
func (s *Service) Serving() { s.hb.Run() }

// SetDataAddress records where the node data listener is bound (before
// Serving: the first report carries it).
func (s *Service) SetDataAddress(addr string) { s.dataAddr.Store(&addr) }

// DataAddress is where the node data listener is bound, "" when none.
func (s *Service) DataAddress() string {
	if p := s.dataAddr.Load(); p != nil {
		return *p
	}
	return ""
}

// Close stops the background loops and closes the store. Sandboxes keep
// running: a restarted cubelet adopts them.
func (s *Service) Close() error {
	var err error
	s.closeOnce.Do(func() {
		s.hb.Stop()
		s.stop() // aborts an in-flight journal or GC pass too
		<-s.gcDone
		<-s.healthDone
		<-s.usageDone
		s.stopPool()
		s.stopWatch()
		s.stopStorage()
		err = s.store.Close()
		// The node's cgroup parent goes with the last sandbox: rmdir
		// only, which the kernel refuses while any sandbox's cgroup (they
		// outlive a cubelet restart) is under it.
		_, _ = cgroups.Remove("/"+s.cfg.Node.CgroupParent, 0)
	})
	return err
}

// Metrics is the registry served on /metrics.
func (s *Service) Metrics() *prometheus.Registry { return s.metrics }

// Config returns the configuration the service runs with.
func (s *Service) Config() *config.Config { return s.cfg }

// FlowInfo describes one flow for admin tools.
type FlowInfo struct {
	Name     string
	Limit    int
	InFlight int
	Steps    [][]string
}

// Flows lists the configured flows with their live limits.
func (s *Service) Flows() []FlowInfo {
	limits := s.engine.Limits()
	var out []FlowInfo
	for _, f := range s.engine.Flows() {
		l := limits[f]
		out = append(out, FlowInfo{Name: f, Limit: l.Limit, InFlight: l.InFlight, Steps: s.engine.Steps(f)})
	}
	return out
}

// SetFlowLimit changes a flow's concurrency limit at run time.
func (s *Service) SetFlowLimit(flow string, limit int) (FlowInfo, error) {
	if err := s.engine.SetLimit(flow, limit); err != nil {
		return FlowInfo{}, err
	}
	for _, f := range s.Flows() {
		if f.Name == flow {
			return f, nil
		}
	}
	return FlowInfo{}, fmt.Errorf("flow %q: %w", flow, errdefs.ErrNotFound)
}

// ReloadFlows swaps in the flows of a new config (SIGHUP). Other settings
// need a restart.
func (s *Service) ReloadFlows(cfg *config.Config) error {
	return s.engine.Reload(cfg.Flows)
}
