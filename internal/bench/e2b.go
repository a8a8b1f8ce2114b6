package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"runtime/pprof"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	envdpb "github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
	"github.com/cubesandbox/cube/internal/bench/report"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/proxy"
	"github.com/cubesandbox/cube/internal/testbin"
)

// The E2B scenarios time what a user of an E2B SDK waits for on one node,
// through the whole system: the E2B REST API of cubemaster, the node it
// creates on, and the sandbox route in front of the sandbox's envd. The
// system is the bench's own (package mastertest: cubemaster in-process
// with its route, one in-process cubelet holding the busybox template,
// runc), built once per run on first use and torn down with it.
//
// The node keeps a warm pool for the templates the scenarios create
// from, configured as production configures one ([warm_pool] of the
// cubelet, its default sandbox limits those cubemaster gives every
// sandbox, so a claim has no limits to change), so their creates are
// served from the pool; a create the pool did not serve is a failure,
// except in e2b-tti-cold, which creates from a template without a pool.
//
//   - e2b: POST /sandboxes, then the first envd /health through the
//     route (the sandbox answers), timed together; the sandbox is then
//     deleted (not timed). Against a bare `runc run -d` + first /health.
//   - e2b-tti and e2b-tti-burst: time to interactive in the shape of the
//     cross-vendor benchmark: POST /sandboxes, then envd runs `true`
//     (process.Start through the route, to its end event); one at a time,
//     and a burst of 100 at once (all live together: --max-live does
//     not split it). A sample at c=1 waits (untimed) for a full pool, so
//     no refill runs alongside it; a burst starts at a full pool of its
//     size.
//   - e2b-tti-cold: e2b-tti from a template the node keeps no pool for
//     (every create starts a container).

// The E2B system's templates: one the node keeps a pool of e2bPoolSize
// for (the c=1 scenarios), one with a pool of the burst's size, and one
// without a pool (e2b-tti-cold).
const (
	e2bTemplate      = "busybox"
	e2bBurstTemplate = "busybox-burst"
	e2bColdTemplate  = "busybox-cold"
	e2bPoolSize      = 2
)

// e2bBurstN is the size of the burst in e2b-tti-burst, and of its pool.
func e2bBurstN(o report.Options) int { return max(1, min(100, o.N50)) }

// e2bNodeTOML is the node's config: the pools, and as default limits
// those cubemaster gives every sandbox, as a production node that pools
// has them (a claim with other limits runs `runc update`, ~10 ms).
func e2bNodeTOML(o report.Options, m *master.Config) string {
	return fmt.Sprintf("[sandbox]\ndefault_milli_cpu = %d\ndefault_memory_mib = %d\n[warm_pool]\n[warm_pool.templates]\n%q = %d\n%q = %d\n",
		m.Sandbox.MilliCPU, m.Sandbox.MemoryMiB, e2bTemplate, e2bPoolSize, e2bBurstTemplate, e2bBurstN(o))
}

const e2bMasterTOML = "[scheduler]\ncpu_overcommit = 256.0\n"

func init() {
	probe := func(ctx context.Context, e *Env) error {
		if os.Geteuid() != 0 {
			return skipf("it starts a cubemaster and a cubelet of its own (root)")
		}
		if testbin.Root() == "" {
			return skipf("it builds the system from source: run it from the repository")
		}
		if rt := e.Opts.Runtime; rt != "" && rt != "runc" {
			return skipf("its system runs runc sandboxes (this run is for %s)", rt)
		}
		return nil
	}
	Register(Scenario{
		Name: "e2b", Kind: report.KindCube,
		Help:      "E2B round trip from the warm pool: POST /sandboxes on the E2B API + first envd /health through the route (then DELETE, not timed)",
		Baselines: []string{"runc-run", "podman-run"},
		Params:    func(o report.Options) report.Params { return report.Params{N: o.N1, Concurrency: 1} },
		Probe:     probe,
		Run:       runE2B("e2b", e2bTemplate, false),
		Finish:    finishE2B,
	})
	Register(Scenario{
		Name: "e2b-tti", Kind: report.KindCube,
		Help:      "time to interactive from the warm pool: POST /sandboxes + envd runs `true` through the route, one at a time",
		Baselines: []string{"runc-run"},
		Params:    func(o report.Options) report.Params { return report.Params{N: o.N1, Concurrency: 1} },
		Probe:     probe,
		Run:       runE2B("e2b-tti", e2bTemplate, true),
		Finish:    finishE2B,
	})
	Register(Scenario{
		Name: "e2b-tti-burst", Kind: report.KindCube,
		Help: "time to interactive for a burst of 100 (--n-c50 when smaller) at once, from a full warm pool of that size (--concurrency does not apply)",
		Params: func(o report.Options) report.Params {
			n := e2bBurstN(o)
			return report.Params{N: n, Concurrency: n}
		},
		Probe:  probe,
		Run:    runE2B("e2b-tti-burst", e2bBurstTemplate, true),
		Finish: finishE2B,
	})
	Register(Scenario{
		Name: "e2b-tti-cold", Kind: report.KindCube,
		Help:      "e2b-tti from a template without a warm pool (each create starts a container)",
		Baselines: []string{"runc-run"},
		Params:    func(o report.Options) report.Params { return report.Params{N: o.N1, Concurrency: 1} },
		Probe:     probe,
		Run:       runE2B("e2b-tti-cold", e2bColdTemplate, true),
		Finish:    finishE2B,
	})
}

// benchE2B is the run's single-node E2B system, built on first use.
type benchE2B struct {
	ownSystem
	m     *mastertest.Master
	node  *mastertest.Node
	api   *mastertest.Client
	route string // the sandbox route's base URL

	mu   sync.Mutex
	aggs map[string]*e2bAgg
}

// e2bAgg is a scenario's split of its samples, over all its chunks.
type e2bAgg struct {
	creates, firsts []time.Duration
	pooled, cold    int // creates the pool served, and those it did not
	// seconds is a second command right after the first (untimed): what
	// the first paid for being first.
	seconds []time.Duration
	// profiles are cube-bench's own CPU profiles (--profile), one per
	// chunk: cubemaster, its route and the cubelet run in this process.
	profiles []string
	// trace is cubemaster's trace of each create (its "sandbox created"
	// event), by field: where POST /sandboxes spent its time.
	trace map[string][]time.Duration
}

func (b *benchE2B) agg(name string) *e2bAgg {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.aggs == nil {
		b.aggs = map[string]*e2bAgg{}
	}
	if b.aggs[name] == nil {
		b.aggs[name] = &e2bAgg{}
	}
	return b.aggs[name]
}

// e2bSystem builds the system once (later calls return it or the error
// that stopped it).
func (e *Env) e2bSystem(ctx context.Context) (*benchE2B, error) {
	b := &e.e2b
	err := b.build(ctx, e, "e2b", "cubemaster, its route and a cubelet with warm pools", func(tb *benchTB) {
		b.m = mastertest.StartMaster(tb, e2bMasterTOML)
		b.node = mastertest.StartNodeConfig(tb, b.m, e2bNodeTOML(e.Opts, b.m.Config), e2bTemplate, e2bBurstTemplate, e2bColdTemplate)
		b.m.WaitHealthy(tb, b.node)
		b.api = b.m.API(b.m.APIKey(tb))
		b.route = "http://" + b.m.Server.ProxyAddr
	})
	return b, err
}

// close tears the system down.
func (b *benchE2B) close() error { return b.ownSystem.close("e2b") }

// poolsFull waits (untimed) until every pool of the node holds its
// target and none is filling, so that no refill runs alongside what
// is timed next.
func (b *benchE2B) poolsFull(ctx context.Context) error {
	deadline := time.Now().Add(5 * time.Minute)
	for {
		full, seen := true, 0
		for _, p := range b.node.Svc.Pools() {
			if p.Ready < p.Target || p.Filling > 0 {
				full = false
			}
			if p.TemplateID == e2bTemplate || p.TemplateID == e2bBurstTemplate {
				seen++
			}
		}
		if full && seen == 2 { // both pools known (the refiller has started)
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the node's warm pools are not full after 5 minutes: %+v", b.node.Svc.Pools())
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// profileSelf starts this process's CPU profile into
// dir/cube-bench-cpu-<i>.pb.gz; stop ends it and returns the file.
func profileSelf(dir string, i int) (stop func() string, err error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	name := filepath.Join(dir, fmt.Sprintf("cube-bench-cpu-%03d.pb.gz", i))
	f, err := os.Create(name)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("profile cube-bench: %w", err)
	}
	return func() string {
		pprof.StopCPUProfile()
		_ = f.Close()
		return name
	}, nil
}

// trace is cubemaster's trace of sandbox id's create, from its "sandbox
// created" event: the trace.* fields, without the prefix (flow dropped).
func (b *benchE2B) trace(ctx context.Context, id string) map[string]time.Duration {
	evs, err := b.m.Server.Service.Events(ctx, catalog.EventQuery{SandboxID: id})
	if err != nil {
		return nil
	}
	out := map[string]time.Duration{}
	for _, ev := range evs {
		if ev.Message != "sandbox created" {
			continue
		}
		for k, v := range ev.Fields {
			name, ok := strings.CutPrefix(k, master.TracePrefix)
			if f, err := strconv.ParseFloat(v, 64); ok && err == nil {
				out[name] = time.Duration(f * float64(time.Millisecond))
			}
		}
	}
	return out
}

// fromPool says whether the node served sandbox id from a pool entry
// (its resources are held under the entry's ID).
func (b *benchE2B) fromPool(ctx context.Context, id string) (bool, error) {
	rec, err := b.node.Svc.Get(ctx, id)
	if err != nil {
		return false, err
	}
	return strings.HasPrefix(rec.HostKey(), "pool-"), nil
}

func runE2B(name, tmpl string, command bool) func(context.Context, *Env, report.Params) (*report.Result, error) {
	wantPool := tmpl != e2bColdTemplate
	return func(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
		b, err := e.e2bSystem(ctx)
		if err != nil {
			return nil, err
		}
		hc := &http.Client{Timeout: time.Minute, Transport: &http.Transport{MaxIdleConnsPerHost: p.Concurrency}}
		agg := b.agg(name)
		if e.Opts.ProfileDir != "" {
			stop, err := profileSelf(filepath.Join(e.Opts.ProfileDir, name), len(agg.profiles))
			if err != nil {
				return nil, err
			}
			defer func() { agg.profiles = append(agg.profiles, stop()) }()
		}
		var all driveResult
		var mu sync.Mutex
		live := e.Opts.MaxLive
		burst := p.Concurrency == p.N && p.N > 1
		if burst {
			live = p.N
		}
		for _, n := range rounds(p.N, live) {
			var ids []string
			creates := map[string]time.Duration{} // of the samples that succeeded
			if burst {
				if err := b.poolsFull(ctx); err != nil {
					return nil, err
				}
			}
			e.Progress.Start(name, n)
			d := drive(ctx, e.Progress, n, p.Concurrency, func(ctx context.Context, _ int) (time.Duration, error) {
				if !burst {
					if err := b.poolsFull(ctx); err != nil {
						return 0, err
					}
				}
				id, create, first, err := b.createFirst(ctx, hc, tmpl, command)
				mu.Lock()
				if id != "" {
					ids = append(ids, id)
				}
				mu.Unlock()
				if err != nil {
					return 0, err
				}
				pooled, err := b.fromPool(ctx, id)
				if err != nil {
					return 0, fmt.Errorf("sandbox %s on the node: %w", id, err)
				}
				// Not in a burst: it would load the samples still running.
				if command && !burst {
					began := time.Now()
					if err := b.runTrue(ctx, hc, id); err != nil {
						return 0, fmt.Errorf("sandbox %s: second command: %w", id, err)
					}
					mu.Lock()
					agg.seconds = append(agg.seconds, time.Since(began))
					mu.Unlock()
				}
				mu.Lock()
				defer mu.Unlock()
				if pooled {
					agg.pooled++
				} else {
					agg.cold++
				}
				if pooled != wantPool {
					return 0, fmt.Errorf("sandbox %s: served from the warm pool: %t, want %t", id, pooled, wantPool)
				}
				agg.creates = append(agg.creates, create)
				agg.firsts = append(agg.firsts, first)
				creates[id] = create
				return create + first, nil
			})
			e.Progress.Finish()
			all.merge(d)
			// cubemaster's traces, read once the round is over.
			for id, create := range creates {
				tr := b.trace(ctx, id)
				if agg.trace == nil {
					agg.trace = map[string][]time.Duration{}
				}
				for k, d := range tr {
					agg.trace[k] = append(agg.trace[k], d)
				}
				if total, ok := tr["total"]; ok {
					agg.trace["outside the trace"] = append(agg.trace["outside the trace"], create-total)
				}
			}
			if err := b.killAll(context.WithoutCancel(ctx), ids, p.Concurrency); err != nil {
				return nil, err
			}
			if err := ctx.Err(); err != nil {
				return nil, err
			}
		}
		return all.result(name, report.KindCube, p)
	}
}

func finishE2B(e *Env, r *report.Result) {
	b := &e.e2b
	a := b.agg(r.Scenario)
	first := "first envd /health through the route"
	if r.Scenario != "e2b" {
		first = "envd process.Start(`true`) through the route, to its end"
	}
	r.Notes = append(r.Notes,
		summary("E2B POST /sandboxes alone", a.creates),
		summary(first, a.firsts),
		fmt.Sprintf("creates served from the warm pool: %d of %d", a.pooled, a.pooled+a.cold))
	if len(a.seconds) > 0 {
		r.Notes = append(r.Notes, summary("a second process.Start(`true`) right after (untimed)", a.seconds))
	}
	keys := make([]string, 0, len(a.trace))
	for k := range a.trace {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		r.Notes = append(r.Notes, summary("cubemaster create trace: "+k, a.trace[k]))
	}
	if len(a.profiles) > 0 {
		r.Notes = append(r.Notes, fmt.Sprintf("CPU profiles of cube-bench (cubemaster, route, cubelet in-process; not the agents): %s (go tool pprof -top %s)",
			strings.Join(a.profiles, " "), strings.Join(a.profiles, " ")))
	}
	r.Notes = append(r.Notes,
		fmt.Sprintf("system (cubemaster, route, cubelet) built in %s", b.built.Round(time.Millisecond)))
}

// createFirst creates a sandbox through the E2B API and then either asks
// its envd /health or has envd run `true`, through the route.
func (b *benchE2B) createFirst(ctx context.Context, hc *http.Client, tmpl string, command bool) (id string, create, first time.Duration, err error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, b.api.Base+"/sandboxes",
		strings.NewReader(fmt.Sprintf(`{"templateID":%q,"timeout":600}`, tmpl)))
	if err != nil {
		return "", 0, 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	var out struct {
		SandboxID string `json:"sandboxID"`
	}
	start := time.Now()
	r, err := b.api.Try(req, &out)
	create = time.Since(start)
	if err != nil {
		return "", create, 0, fmt.Errorf("create: %w", err)
	}
	if r.StatusCode/100 != 2 || out.SandboxID == "" {
		return "", create, 0, fmt.Errorf("create: %s %s", r.Status, bytes.TrimSpace(r.Body))
	}
	id = out.SandboxID
	start = time.Now()
	if command {
		err = b.runTrue(ctx, hc, id)
	} else {
		err = b.health(ctx, hc, id)
	}
	first = time.Since(start)
	if err != nil {
		return id, create, first, fmt.Errorf("sandbox %s: %w", id, err)
	}
	return id, create, first, nil
}

func (b *benchE2B) health(ctx context.Context, hc *http.Client, id string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, b.route+"/health", nil)
	if err != nil {
		return err
	}
	req.Header.Set(proxy.HeaderSandboxID, id)
	req.Header.Set(proxy.HeaderSandboxPort, clusterEnvdPort)
	resp, err := hc.Do(req)
	if err != nil {
		return fmt.Errorf("envd /health: %w", err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("envd /health: %s", resp.Status)
	}
	return nil
}

// runTrue has envd run `true` and waits for its end event.
func (b *benchE2B) runTrue(ctx context.Context, hc *http.Client, id string) error {
	return envdTrue(ctx, hc, b.route, id, clusterEnvdPort)
}

// envdTrue has sandbox id's envd run `true` through the proxy at route
// and waits for its end event.
func envdTrue(ctx context.Context, hc *http.Client, route, id, port string) error {
	c := processconnect.NewProcessClient(hc, route)
	req := connect.NewRequest(&envdpb.StartRequest{Process: &envdpb.ProcessConfig{Cmd: "/bin/true"}})
	req.Header().Set(proxy.HeaderSandboxID, id)
	req.Header().Set(proxy.HeaderSandboxPort, port)
	s, err := c.Start(ctx, req)
	if err != nil {
		return fmt.Errorf("envd process.Start: %w", err)
	}
	defer s.Close()
	for s.Receive() {
		if end := s.Msg().GetEvent().GetEnd(); end != nil {
			if end.GetExitCode() != 0 {
				return fmt.Errorf("`true` exited %d", end.GetExitCode())
			}
			return nil
		}
	}
	if err := s.Err(); err != nil {
		return fmt.Errorf("envd process.Start: %w", err)
	}
	return errors.New("envd process.Start: the stream ended without an end event")
}

// killAll deletes sandboxes through the E2B API, c at a time.
func (b *benchE2B) killAll(ctx context.Context, ids []string, c int) error {
	d := drive(ctx, nil, len(ids), c, func(ctx context.Context, i int) (time.Duration, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodDelete, b.api.Base+"/sandboxes/"+ids[i], nil)
		if err != nil {
			return 0, err
		}
		r, err := b.api.Try(req, nil)
		if err == nil && r.StatusCode != http.StatusNoContent && r.StatusCode != http.StatusNotFound {
			err = fmt.Errorf("delete %s: %s %s", ids[i], r.Status, bytes.TrimSpace(r.Body))
		}
		return 0, err
	})
	if d.failed > 0 {
		return fmt.Errorf("%d of %d deletes failed: %w", d.failed, len(ids), errors.Join(d.errs...))
	}
	return nil
}
