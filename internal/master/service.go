// Package master is cubemaster: the control plane that places sandboxes on
// nodes and keeps track of them. Service is the in-process API; its edges
// are package nodeapi (gRPC for cubelets and cubecli) and package e2bapi
// (the E2B-compatible REST API), and it serves as the Resolver of the
// data-plane route (package proxy).
//
// The SQL catalog is the source of truth for what the cluster should hold:
// every sandbox row is written before its node is asked to create it, so a
// master that dies at any instant finds, on restart, every sandbox it may
// have started (see reconcile.go). The nodes are the truth for what runs.
//
// Lifecycle of a sandbox as the catalog sees it:
//
//	        create                pause
//	(none) --------> creating ---> running <------> paused
//	                    |            |      resume/     |
//	                    | failed     | kill,  connect   | kill
//	                    v            v expiry           v
//	                 (none)        (none)             (none)
//
// Deadlines: a running sandbox past its end_at is killed, or paused when it
// was created with autoPause (expiry.go). A paused sandbox has no deadline
// until it runs again.
package master

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/cubesandbox/cube/internal/master/apikey"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/scheduler"
	"github.com/cubesandbox/cube/internal/master/secretbox"
	"github.com/cubesandbox/cube/internal/nodetunnel"
	"github.com/cubesandbox/cube/internal/pki"
	"github.com/cubesandbox/cube/internal/proxy"
)

// ManagedLabel marks the sandboxes cubemaster creates, so a node's
// reconcile can tell them from sandboxes made with cubecli directly.
const (
	ManagedLabel = "cube.managed-by"
	ManagedValue = "cubemaster"
)

// Service is cubemaster.
type Service struct {
	cfg    *Config
	log    *slog.Logger
	cat    *catalog.Catalog
	keys   *apikey.Keys
	sched  *scheduler.Scheduler
	reg    *registry
	self   identity
	dialer proxy.Dialer
	// joinCA signs joining nodes' certificates (join.ca_dir); nil: no joins.
	joinCA *pki.CA
	// egressCA is the cluster's egress CA handed to joining nodes
	// (join.ca_dir); nil when joins are off.
	egressCA *egressCA
	agents   *agentClient
	routes   *routeCache
	// stored is the template store (distribute.go).
	stored *storedTemplates
	// activity feeds the idle policy (proxyroutes.go).
	activity *activity
	// box seals and opens teams' secrets (secrets.go); nil: noBox says
	// why the secrets API is off.
	box   *secretbox.Box
	noBox string

	locks keyedMutex

	refreshMu   sync.Mutex
	lastRefresh time.Time // templates re-read from the nodes
	// creating holds the IDs of creates in flight in this process, so
	// reconcile leaves their rows alone.
	creating sync.Map
	// forking holds the IDs of the snapshots of forks in flight in this
	// process, so reconcile leaves them alone.
	forking sync.Map
	// moving holds the IDs of sandboxes being moved to another node in
	// this process (moveElsewhere): the route waits for the move rather
	// than call them paused.
	moving sync.Map
	// leaving holds, per sandbox moved off a node, a channel closed once
	// the move's cleanup (the original destroyed, the move's snapshot
	// deleted), run after the move answered, is done (shipping.go).
	leaving sync.Map
	// lostNoted holds the paused sandboxes of lost nodes already told
	// that they will resume elsewhere (one event per loss).
	lostNoted sync.Map
	// lead runs the lifecycle loops while this replica holds their lease
	// (lease.go).
	lead *leader

	ctx    context.Context // ends at Close
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// identity is this machine and PID namespace: a node with the same one
// runs here, and its sandboxes' network namespaces can be entered.
type identity struct{ bootID, pidNS string }

func selfIdentity() identity {
	var id identity
	if b, err := os.ReadFile("/proc/sys/kernel/random/boot_id"); err == nil {
		id.bootID = strings.TrimSpace(string(b))
	}
	id.pidNS, _ = os.Readlink("/proc/self/ns/pid")
	return id
}

// tunnelDialer reaches sandboxes through their nodes' data listeners
// with the master's certificate; nil without [tls].
func tunnelDialer(tc *tls.Config) *nodetunnel.Dialer {
	if tc == nil {
		return nil
	}
	return &nodetunnel.Dialer{TLS: tc}
}

// Dialer is how the service reaches sandboxes (through their nodes' data
// listeners when they serve one); the plain route uses it too.
func (s *Service) Dialer() proxy.Dialer { return s.dialer }

// Option adjusts a Service.
type Option func(*Service)

// WithDialer replaces the dialer used to reach sandboxes (agent calls and
// the route).
func WithDialer(d proxy.Dialer) Option { return func(s *Service) { s.dialer = d } }

// New opens the catalog (applying migrations), loads the nodes it knows,
// and starts the background loops: node health, deadlines, and a
// reconcile of every known node.
func New(ctx context.Context, cfg *Config, log *slog.Logger, opts ...Option) (*Service, error) {
	if log == nil {
		log = slog.Default()
	}
	nodeTLS, err := cfg.TLS.Client("tls")
	if err != nil {
		return nil, err
	}
	joinCA, err := loadJoinCA(cfg.Join.CADir)
	if err != nil {
		return nil, err
	}
	egressCA, err := loadEgressCA(cfg.Join.CADir, log)
	if err != nil {
		return nil, err
	}
	stored, err := newStoredTemplates(cfg.Templates.StoreDir)
	if err != nil {
		return nil, err
	}
	cat, err := catalog.Open(ctx, cfg.Catalog.Driver, cfg.Catalog.DSN)
	if err != nil {
		return nil, err
	}
	box, noBox, err := openSecretBox(cfg)
	if err != nil {
		cat.Close()
		return nil, err
	}
	quarantine(ctx, cat, log)
	bg, cancel := context.WithCancel(context.Background())
	s := &Service{
		cfg: cfg, log: log, cat: cat,
		keys:     apikey.New(cat, cfg.APIKeys.CacheTTL.Duration, log),
		sched:    scheduler.New(cfg.Scheduler),
		reg:      &registry{nodes: map[string]*nodeState{}, tls: nodeTLS},
		self:     selfIdentity(),
		dialer:   proxy.NetDialer{Tunnel: tunnelDialer(nodeTLS)},
		routes:   newRouteCache(),
		stored:   stored,
		joinCA:   joinCA,
		egressCA: egressCA,
		activity: newActivity(),
		box:      box, noBox: noBox,
		ctx: bg, cancel: cancel,
	}
	for _, o := range opts {
		o(s)
	}
	s.agents = newAgentClient(s)
	if err := s.loadNodes(ctx); err != nil {
		cancel()
		cat.Close()
		return nil, err
	}
	// The loops that must run once per catalog run under its lease: with
	// one replica it is this one's at once.
	loops := []func(context.Context){s.expiryLoop, s.idleLoop, s.reconcileAll, s.lostLoop}
	s.lead = newLeader(s)
	if s.shared() {
		loops = append(loops, s.sweepCreates, s.pruneShared)
		s.routes.share = make(chan string, 4096)
		seen := newSeenSet()
		s.goBackground(s.refreshNodes)
		s.goBackground(func(ctx context.Context) { s.shareRoutes(ctx, seen) })
		s.goBackground(func(ctx context.Context) { s.followRoutes(ctx, seen) })
		s.goBackground(s.flushActivity)
	}
	s.lead.loops = loops
	if err := s.shareTemplates(ctx, s.lead.replica); err != nil {
		cancel()
		s.wg.Wait()
		cat.Close()
		return nil, err
	}
	s.goBackground(s.watchHealth)
	s.goBackground(s.lead.run)
	log.Info("cubemaster catalog open", "driver", cfg.Catalog.Driver, "nodes", len(s.reg.nodes), "replica", s.lead.replica)
	return s, nil
}

// shared reports whether the catalog may have other replicas (MySQL);
// SQLite is one machine's file, one master's.
func (s *Service) shared() bool { return s.cfg.Catalog.Driver == catalog.MySQL }

// goBackground runs fn until Close.
func (s *Service) goBackground(fn func(ctx context.Context)) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		fn(s.ctx)
	}()
}

// Close stops the background loops and closes node connections and the
// catalog. Sandboxes are untouched.
func (s *Service) Close() error {
	s.cancel()
	s.wg.Wait()
	s.reg.mu.Lock()
	for _, ns := range s.reg.nodes {
		if ns.conn != nil {
			ns.conn.Close()
		}
	}
	s.reg.mu.Unlock()
	return s.cat.Close()
}

// Config is the configuration the service runs with.
func (s *Service) Config() *Config { return s.cfg }

// Keys is the API key store.
func (s *Service) Keys() *apikey.Keys { return s.keys }

// Ping checks the catalog answers (GET /health).
func (s *Service) Ping(ctx context.Context) error { return s.cat.Ping(ctx) }

// event appends to a sandbox's log; failures are only logged.
// Audit records that the holder of an API key did action to a sandbox:
// who (the key's team, name and ID) did what to which sandbox. It goes to the
// master's log always and to the sandbox's event log (the E2B logs
// endpoint) while the sandbox has one: a kill removes the sandbox's row
// and its events, so its audit line is in the master's log only.
func (s *Service) Audit(ctx context.Context, sandboxID, action string, key *catalog.APIKey) {
	fields := map[string]string{"audit": action}
	who := "an unknown key"
	if key != nil {
		fields["api_key_id"], fields["api_key_name"], fields["team"] = key.ID, key.Name, key.Team
		who = fmt.Sprintf("API key %q (%s) of team %q", key.Name, key.ID, key.Team)
	}
	s.log.Info("audit", "sandbox_id", sandboxID, "action", action, "team", fields["team"], "api_key_id", fields["api_key_id"], "api_key_name", fields["api_key_name"])
	if _, err := s.cat.GetSandbox(ctx, sandboxID); err != nil {
		return
	}
	s.event(sandboxID, "info", "audit: "+action+" by "+who, fields)
}

func (s *Service) event(sandboxID, level, msg string, fields map[string]string) {
	if err := s.cat.AddEvent(context.Background(), catalog.Event{SandboxID: sandboxID, Level: level, Message: msg, Fields: fields}); err != nil {
		s.log.Warn("record sandbox event", "sandbox_id", sandboxID, "err", err)
	}
}

// keyedMutex is one mutex per key, created on demand and dropped when
// unused: verbs on one sandbox run one at a time in this process, verbs on
// different sandboxes never wait for each other.
type keyedMutex struct {
	mu sync.Mutex
	m  map[string]*keyedEntry
}

type keyedEntry struct {
	ch   chan struct{}
	refs int
}

// lock takes the key's lock or gives up when ctx ends.
func (k *keyedMutex) lock(ctx context.Context, key string) (func(), error) {
	k.mu.Lock()
	if k.m == nil {
		k.m = map[string]*keyedEntry{}
	}
	e := k.m[key]
	if e == nil {
		e = &keyedEntry{ch: make(chan struct{}, 1)}
		k.m[key] = e
	}
	e.refs++
	k.mu.Unlock()
	release := func() {
		k.mu.Lock()
		e.refs--
		if e.refs == 0 {
			delete(k.m, key)
		}
		k.mu.Unlock()
	}
	select {
	case e.ch <- struct{}{}:
		return func() { <-e.ch; release() }, nil
	case <-ctx.Done():
		release()
		return nil, fmt.Errorf("sandbox %s is busy: %w", key, ctx.Err())
	}
}

// VerifyAPIKey checks a presented X-API-Key.
func (s *Service) VerifyAPIKey(ctx context.Context, secret string) (*catalog.APIKey, error) {
	return s.keys.Verify(ctx, secret)
}
