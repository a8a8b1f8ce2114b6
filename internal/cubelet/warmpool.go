package cubelet

import (
	"context"
	"crypto/rand"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cubesandbox/cube/internal/cubelet/actions"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/sandboxid"
	"github.com/cubesandbox/cube/internal/workflow"
)

// Warm pools (docs/pools.md): per template, sandboxes started ahead of
// creates by the ordinary create flow, then frozen. A pool entry is a
// sandbox record like any other (reconcile, the runtime watch and the
// cleanup journal look after it) with LabelPool set, hidden from every
// listing, lookup and count users see. A create claims one: one store
// transaction replaces the entry's record by the new sandbox's, which
// keeps the entry's node resources (Record.HostID); the claim then gives
// the container the sandbox's hostname, limits and network policy, thaws
// it and re-initialises its agent with the sandbox's env, token, clock
// and entropy, the reinit a clone restored from memory gets.
//
// A VM's entries are clones of the template's warm snapshot (its memory
// shared with the template's, docs/vm.md), never cold boots: a runtime
// whose sandboxes boot a disk keeps a pool only for a warm template
// (fromWarm).

// FailpointClaimRecord is evaluated by a claim before it writes the
// sandbox's record over the entry's.
const FailpointClaimRecord = "pool/claim.record/before"

// FailpointClaimRunning is evaluated by a claim once its record is
// written and the sandbox re-initialised, before it is recorded running.
const FailpointClaimRunning = "pool/claim.running/before"

// LabelPool marks a warm pool's entry; its value is the template ID.
const LabelPool = "cube.pool"

// pooled says whether rec is a warm pool's entry (not a user's sandbox).
func pooled(rec *sandbox.Record) bool { return rec.Labels[LabelPool] != "" }

// warmPool is the node's pools: which entries are ready to claim, and the
// refiller.
type warmPool struct {
	s *Service

	mu sync.Mutex
	// ready: entries that are frozen and claimable, by template, oldest
	// first. filling: refills in flight, by template.
	ready   map[string][]string
	filling map[string]int
	// blocked: templates being deleted (no refill).
	blocked map[string]bool
	// recent: when creates of each template asked for an entry, within
	// the rate window (the adaptive size).
	recent map[string][]time.Time
	// Counters for /metrics.
	hits, misses, refills, refillErrors map[string]uint64

	// claiming: claims in flight. The refiller waits for them as it waits
	// for create flows (a claim runs no flow, so the engine does not
	// count it): a refill started under a claim takes the cores its
	// thaw and reinit want.
	claiming atomic.Int32

	kick chan struct{}
	done chan struct{}
	// lastScan is when reap last looked at every record for stale
	// entries (a walk of the whole map, so not on every tick).
	lastScan time.Time
}

// PoolStats is one template's pool.
type PoolStats struct {
	TemplateID                  string
	Ready, Filling, Target      int
	Hits, Misses, Refills, Errs uint64
}

func newWarmPool(s *Service) *warmPool {
	return &warmPool{
		s: s, ready: map[string][]string{}, filling: map[string]int{}, blocked: map[string]bool{},
		recent: map[string][]time.Time{}, hits: map[string]uint64{}, misses: map[string]uint64{},
		refills: map[string]uint64{}, refillErrors: map[string]uint64{},
		kick: make(chan struct{}, 1), done: make(chan struct{}),
	}
}

// startPool adopts the entries a previous cubelet left (reconcile has
// checked them against the runtime: live ones are Paused) and starts the
// refiller. Entries no longer wanted (pool off, template gone, dead) are
// destroyed by the refiller's first pass.
func (s *Service) startPool(ctx context.Context) {
	p := newWarmPool(s)
	s.pool = p
	s.mu.Lock()
	var recs []*sandbox.Record
	for _, e := range s.boxes {
		if r := e.rec.Load(); pooled(r) {
			recs = append(recs, r)
		}
	}
	s.mu.Unlock()
	sortRecords(recs)
	adopted := 0
	for _, r := range recs {
		if r.State == lifecycle.Paused && r.PauseMode != sandbox.PauseDisk {
			p.ready[r.Labels[LabelPool]] = append(p.ready[r.Labels[LabelPool]], r.ID)
			adopted++
		}
	}
	if len(recs) > 0 {
		s.log.Info("warm pool: entries found at start", "adopted", adopted, "other", len(recs)-adopted)
	}
	s.metrics.MustRegister(&poolCollector{p: p})
	go p.loop(ctx)
}

// stopPool stops the refiller and destroys every entry: a stopped node
// holds no idle pool containers (a crash's are adopted at the next start).
func (s *Service) stopPool() {
	p := s.pool
	if p == nil {
		return
	}
	<-p.done
	for _, id := range s.poolEntries("") {
		if err := s.destroyPoolEntry(context.Background(), id); err != nil {
			s.log.Warn("warm pool: destroy entry at close", "sandbox_id", id, "err", err)
		}
	}
}

// poolEntries lists the IDs of every pool entry record, of template tmpl
// ("" = all), ready or not.
func (s *Service) poolEntries(tmpl string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for id, e := range s.boxes {
		if r := e.rec.Load(); pooled(r) && (tmpl == "" || r.Labels[LabelPool] == tmpl) {
			out = append(out, id)
		}
	}
	sort.Strings(out)
	return out
}

// target is the number of entries template id's pool keeps now: its
// configured size, grown to the creates of the last rate window, at most
// the configured maximum. p.mu is held.
func (p *warmPool) target(id string, now time.Time) int {
	c := p.s.cfg.WarmPool
	base := c.SizeFor(id)
	if base <= 0 {
		return 0
	}
	recent := p.recent[id]
	cut := 0
	for cut < len(recent) && now.Sub(recent[cut]) > c.RateWindow.Duration {
		cut++
	}
	recent = recent[cut:]
	p.recent[id] = recent
	return min(max(base, len(recent)), c.Max)
}

// take removes and returns the oldest ready entry of template id, or "".
func (p *warmPool) take(id string) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.recent[id] = append(p.recent[id], time.Now())
	if len(p.recent[id]) > 4*p.s.cfg.WarmPool.Max+16 {
		p.recent[id] = p.recent[id][1:]
	}
	q := p.ready[id]
	if len(q) == 0 {
		p.misses[id]++
		return ""
	}
	p.ready[id] = q[1:]
	p.hits[id]++
	return q[0]
}

func (p *warmPool) wake() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// loop refills the pools: one entry at a time, refill_interval apart,
// and only while no create is in flight, so a refill never holds a slot
// or a core a user's create wants.
func (p *warmPool) loop(ctx context.Context) {
	defer close(p.done)
	interval := p.s.cfg.WarmPool.RefillInterval.Duration
	tick := time.NewTicker(100 * time.Millisecond) // claims and template deletes wake it at once
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case <-p.kick:
		}
		p.reap(ctx)
		for ctx.Err() == nil {
			// A create from a warm template runs the clone flow.
			if l := p.s.engine.Limits(); l[FlowCreate].InFlight > 0 || l[FlowClone].InFlight > 0 || p.claiming.Load() > 0 {
				break // a user's create runs: refill after it
			}
			tmpl, ok := p.next()
			if !ok {
				break
			}
			p.fill(ctx, tmpl)
			if interval > 0 {
				select {
				case <-ctx.Done():
					return
				case <-time.After(interval):
				}
			}
		}
	}
}

// next picks the template whose pool is furthest below its target and
// counts a refill in flight for it.
func (p *warmPool) next() (*sandbox.Template, bool) {
	tmpls, err := p.s.store.ListTemplates()
	if err != nil {
		return nil, false
	}
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	var best *sandbox.Template
	bestGap := 0
	for _, t := range tmpls {
		if p.blocked[t.ID] || !p.poolRuntime(t) || p.fromWarm(t) && p.warmID(t) == "" {
			continue
		}
		if gap := p.target(t.ID, now) - len(p.ready[t.ID]) - p.filling[t.ID]; gap > bestGap {
			best, bestGap = t, gap
		}
	}
	if best == nil {
		return nil, false
	}
	p.filling[best.ID]++
	return best, true
}

// poolRuntime says whether template t's creates run on a runtime pools
// are kept for.
func (p *warmPool) poolRuntime(t *sandbox.Template) bool {
	rt := p.runtimeOf(t)
	for _, r := range p.s.cfg.WarmPool.Runtimes {
		if r == rt {
			_, err := p.s.node.Driver(rt)
			return err == nil
		}
	}
	return false
}

// fromWarm says whether template t's entries are clones of its warm
// snapshot: for a runtime that boots a disk (VMs), a cold boot takes
// seconds of CPU and its entry would own all of its guest's memory, where
// a clone restores in a fraction of that and maps the template's pages.
func (p *warmPool) fromWarm(t *sandbox.Template) bool {
	d, err := p.s.node.Driver(p.runtimeOf(t))
	return err == nil && d.Capabilities().BootsDisk
}

// warmID is template t's warm snapshot on its pool's runtime, "" when it
// has none (a create would then boot).
func (p *warmPool) warmID(t *sandbox.Template) string {
	req := CreateRequest{Runtime: p.runtimeOf(t)}
	if sn := p.s.warmSnapshotFor(t, &req); sn != nil {
		return sn.ID
	}
	return ""
}

func (p *warmPool) runtimeOf(t *sandbox.Template) string {
	if t.Runtime != "" {
		return t.Runtime
	}
	return p.s.cfg.Node.DefaultRuntime
}

// fill starts one entry for template t: a cold create under a pool ID
// and a token only this node knows, then frozen.
func (p *warmPool) fill(ctx context.Context, t *sandbox.Template) {
	s := p.s
	id := "pool-" + sandboxid.New()[:16]
	err := s.fillEntry(ctx, id, t.ID, !p.fromWarm(t))
	p.mu.Lock()
	p.filling[t.ID]--
	if err != nil {
		p.refillErrors[t.ID]++
	} else {
		p.refills[t.ID]++
		p.ready[t.ID] = append(p.ready[t.ID], id)
	}
	p.mu.Unlock()
	if err != nil {
		s.log.Warn("warm pool: refill failed", "template_id", t.ID, "err", err)
	}
}

// fillEntry makes entry id of template tmpl: a cold create, or with cold
// false a create from the template's warm snapshot (a VM's clone).
func (s *Service) fillEntry(ctx context.Context, id, tmpl string, cold bool) error {
	res, err := s.Create(ctx, CreateRequest{
		SandboxID: id, TemplateID: tmpl, cold: cold, fill: true,
		Labels: map[string]string{LabelPool: tmpl},
		// Replaced by the claiming sandbox's at reinit, before anyone
		// else reaches the agent.
		AccessToken: rand.Text(),
	})
	if err != nil {
		return err
	}
	if err := s.freezeEntry(ctx, res.Sandbox); err != nil {
		return fmt.Errorf("freeze pool entry %s: %w (destroy: %w)", id, err, s.destroyPoolEntry(ctx, id))
	}
	return nil
}

// prepareTimeout bounds a refill's POST /_cube/prepare: the refiller
// makes one entry at a time, for every template.
const prepareTimeout = 5 * time.Second

func (s *Service) freezeEntry(ctx context.Context, rec *sandbox.Record) error {
	e, err := s.find(rec.ID)
	if err != nil {
		return err
	}
	if err := e.acquire(ctx); err != nil {
		return err
	}
	defer e.release()
	d, err := s.node.Driver(rec.Runtime)
	if err != nil {
		return err
	}
	// The agent builds its envd handlers now, at refill, rather than at
	// the claim's reinit, where a burst of claims shares the cores. Only
	// a speed-up: an agent that does not answer in time (the claim's
	// reinit still has to) is frozen as it is.
	pctx, cancel := context.WithTimeout(ctx, prepareTimeout)
	err = actions.PrepareAgent(pctx, d, e.rec.Load())
	cancel()
	if err != nil {
		s.log.Warn("warm pool: prepare entry's agent", "sandbox_id", rec.ID, "err", err)
	}
	// Likewise only a speed-up: a claim without a spare session dials.
	pctx, cancel = context.WithTimeout(ctx, prepareTimeout)
	err = actions.SpareAgentSession(pctx, d, e.rec.Load())
	cancel()
	if err != nil {
		s.log.Warn("warm pool: entry's agent session", "sandbox_id", rec.ID, "err", err)
	}
	cid := rec.Container.ID
	if err := actions.Settle(ctx, d, cid, runtime.StatusPaused, d.Pause(ctx, cid)); err != nil {
		return err
	}
	t := newTask(s.store, e, e.rec.Load(), nil)
	return t.Update(func(r *sandbox.Record) { r.State, r.PauseMode = lifecycle.Paused, sandbox.PauseMemory })
}

// reap destroys entries that are not ready (dead, failed, left by a
// create cut short) and ready ones above their pool's target.
func (p *warmPool) reap(ctx context.Context) {
	s := p.s
	now := time.Now()
	p.mu.Lock()
	ready := map[string]bool{}
	var excess []string
	for tmpl, q := range p.ready {
		// An entry that died while frozen (the runtime watch marked it
		// failed) is no longer ready, nor one a create of the template
		// would not claim: the template's runtime changed, or a VM
		// entry's warm snapshot is no longer the template's (warmed
		// again). The scan below destroys them.
		t, terr := s.store.GetTemplate(tmpl)
		if terr != nil && !errdefs.IsNotFound(terr) {
			// A store that failed to answer says nothing about the
			// template: its entries stay until the next pass.
			s.log.Warn("warm pool: read template", "template", tmpl, "err", terr)
		} else {
			live := q[:0:0]
			for _, id := range q {
				if e, err := s.find(id); err == nil && terr == nil && e.rec.Load().State == lifecycle.Paused && p.current(t, e.rec.Load()) {
					live = append(live, id)
				}
			}
			q = live
		}
		p.ready[tmpl] = q
		keep := p.target(tmpl, now)
		if p.blocked[tmpl] {
			keep = 0
		}
		if len(q) > keep {
			excess = append(excess, q[keep:]...)
			p.ready[tmpl] = q[:keep]
			q = q[:keep]
		}
		for _, id := range q {
			ready[id] = true
		}
	}
	filling := 0
	for _, n := range p.filling {
		filling += n
	}
	p.mu.Unlock()
	for _, id := range excess {
		if err := s.destroyPoolEntry(ctx, id); err != nil {
			s.log.Warn("warm pool: destroy excess entry", "sandbox_id", id, "err", err)
		}
	}
	if filling > 0 || now.Sub(p.lastScan) < 2*time.Second {
		return // an entry being filled is not ready yet; or scanned lately
	}
	p.lastScan = now
	for _, id := range s.poolEntries("") {
		e, err := s.find(id)
		if err != nil || ready[id] {
			continue
		}
		if st := e.rec.Load().State; st == lifecycle.Creating || st == lifecycle.Destroying && s.journalled(id) {
			continue // a create in flight, or the cleanup loop's
		}
		if err := s.destroyPoolEntry(ctx, id); err != nil {
			s.log.Warn("warm pool: destroy stale entry", "sandbox_id", id, "err", err)
		}
	}
}

// current says whether entry r of template t is what a create of t would
// claim: of t's runtime and, for a VM, a clone of t's warm snapshot now.
func (p *warmPool) current(t *sandbox.Template, r *sandbox.Record) bool {
	if r.Runtime != p.runtimeOf(t) {
		return false
	}
	if !p.fromWarm(t) {
		return true
	}
	// A cold-booted entry (the warm snapshot went before its fill ran)
	// has no source snapshot; "" must not match a template with none.
	return r.SourceSnapshotID != "" && r.SourceSnapshotID == p.warmID(t)
}

// journalled says whether the cleanup loop owns sandbox id.
func (s *Service) journalled(id string) bool {
	js, err := s.store.ListJournal()
	if err != nil {
		return true
	}
	for _, j := range js {
		if j.SandboxID == id {
			return true
		}
	}
	return false
}

// drainPool destroys template id's entries and keeps its pool empty
// until undrain (a template being deleted).
func (s *Service) drainPool(ctx context.Context, id string) error {
	p := s.pool
	if p == nil {
		return nil
	}
	p.mu.Lock()
	p.blocked[id] = true
	p.mu.Unlock()
	for deadline := time.Now().Add(time.Minute); ; {
		p.mu.Lock()
		n := p.filling[id]
		if n == 0 {
			delete(p.ready, id)
		}
		p.mu.Unlock()
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("template %s: a pool refill is still running: %w", id, errdefs.ErrUnavailable)
		}
		time.Sleep(10 * time.Millisecond)
	}
	var first error
	for _, eid := range s.poolEntries(id) {
		if err := s.destroyPoolEntry(ctx, eid); err != nil && first == nil {
			first = err
		}
	}
	return first
}

func (s *Service) undrainPool(id string) {
	if p := s.pool; p != nil {
		p.mu.Lock()
		delete(p.blocked, id)
		p.mu.Unlock()
		p.wake()
	}
}

// destroyPoolEntry destroys one entry like Delete destroys a sandbox.
func (s *Service) destroyPoolEntry(ctx context.Context, id string) error {
	s.mu.Lock()
	e := s.boxes[id]
	s.mu.Unlock()
	if e == nil {
		return nil // gone already
	}
	// Another destroy of it (a drain and the refiller's reap) may have
	// had it first: the entry is then no longer the map's.
	if err := e.acquire(ctx); err != nil {
		return err
	}
	s.mu.Lock()
	cur := s.boxes[id]
	s.mu.Unlock()
	e.release()
	if cur != e {
		return nil
	}
	_, err := s.deleteEntry(ctx, e, id)
	return err
}

// poolClaimable says whether a create can be served from a pool entry:
// not a warm-up or refill, no host mounts (bound at start), the
// template's own runtime, and the disk size the entry was made with.
func (s *Service) poolClaimable(req *CreateRequest, tmpl *sandbox.Template) bool {
	p := s.pool
	if p == nil || req.cold || req.fill || len(req.HostMounts) > 0 || len(req.Volumes) > 0 || req.Resources.DiskMiB != 0 {
		return false
	}
	if req.Runtime != p.runtimeOf(tmpl) || !p.poolRuntime(tmpl) {
		return false
	}
	// Entries run with the default limits: other limits need a runtime
	// that can change them on a running sandbox. A clone of the warm
	// snapshot has the snapshot's shape whatever is asked, as a cold
	// create of a warm template has (createWarm).
	c := s.cfg.Sandbox
	if r := req.Resources; !p.fromWarm(tmpl) && (r.MilliCPU != c.DefaultMilliCPU || r.MemoryMiB != c.DefaultMemoryMiB || r.Pids != c.DefaultPids) {
		d, err := s.node.Driver(req.Runtime)
		if _, ok := d.(runtime.LimitUpdater); err != nil || !ok {
			return false
		}
	}
	return true
}

// claimPooled serves a create from a pool entry. served is false when the
// pool had none (or the claim failed and was undone): the caller creates
// cold. An error with served true is the create's answer.
func (s *Service) claimPooled(ctx context.Context, req CreateRequest, tmpl *sandbox.Template) (res *Result, served bool, err error) {
	p := s.pool
	p.claiming.Add(1)
	defer func() {
		p.claiming.Add(-1)
		p.wake()
	}()
	for range 3 { // an entry that died since it was frozen is skipped
		id := p.take(tmpl.ID)
		if id == "" {
			return nil, false, nil
		}
		res, served, err = s.claim(ctx, req, tmpl, id)
		if served || err != nil {
			return res, served, err
		}
	}
	return nil, false, nil
}

func (s *Service) claim(ctx context.Context, req CreateRequest, tmpl *sandbox.Template, poolID string) (*Result, bool, error) {
	begin := time.Now()
	old, err := s.find(poolID)
	if err != nil {
		return nil, false, nil
	}
	if err := old.acquire(ctx); err != nil {
		return nil, false, err
	}
	prev := old.rec.Load()
	warm := s.pool.fromWarm(tmpl)
	// A clone of a warm snapshot the template no longer points at (it
	// was warmed again since) is stale: a cold create would restore the
	// new one.
	if prev.State != lifecycle.Paused || prev.Container == nil || prev.Runtime != req.Runtime || !s.pool.current(tmpl, prev) {
		old.release()
		// Not the create's to wait for: the service's lifetime bounds it.
		go func() { _ = s.destroyPoolEntry(s.life, poolID) }()
		return nil, false, nil
	}
	rec := &sandbox.Record{
		ID: req.SandboxID, TemplateID: req.TemplateID, Runtime: req.Runtime,
		State: lifecycle.Creating, Labels: req.Labels, Annotations: req.Annotations,
		Env: req.Env, Resources: req.Resources, RequestID: req.RequestID,
		NetworkPolicy: req.Network, AccessToken: req.AccessToken, PoolToken: prev.AccessToken,
		HostID: prev.HostKey(), Disk: prev.Disk, Mount: prev.Mount, Container: prev.Container, Network: prev.Network,
		SourceSnapshotID: prev.SourceSnapshotID,
	}
	var warnings []string
	if warm {
		// The warm snapshot's shape, kept as createWarm keeps it, with
		// the same warning when the request asked for another.
		rec.Resources = prev.Resources
		warnings = warmShapeWarnings(req, prev.Resources)
	}
	rec = rec.Clone()
	s.mu.Lock()
	if _, dup := s.boxes[rec.ID]; dup {
		s.mu.Unlock()
		old.release()
		p := s.pool
		p.mu.Lock()
		p.ready[tmpl.ID] = append([]string{poolID}, p.ready[tmpl.ID]...)
		p.mu.Unlock()
		return nil, true, fmt.Errorf("sandbox %q: %w", rec.ID, errdefs.ErrAlreadyExists)
	}
	rec.CreatedAt = time.Now().UTC() // under s.mu: see Create
	rec.UpdatedAt = rec.CreatedAt
	e := newEntry(rec)
	_ = e.acquire(context.Background()) // fresh entry: never blocks
	e.onPublish = s.watchRecord
	s.boxes[rec.ID] = e
	delete(s.boxes, poolID)
	s.mu.Unlock()
	defer e.release()
	s.disarm(poolID)
	// The record is replaced while the claim runs: once thawed (ApplyClaim
	// thaws first), the entry is never taken back as ready (reconcile finds
	// it running, the refiller destroys it), so nothing the claim does to
	// it needs the new record durable first. The answer waits for both.
	claimed := time.Now()
	recorded := make(chan error, 1)
	go func() {
		if err := failpoint.Eval(ctx, FailpointClaimRecord); err != nil {
			recorded <- err
			return
		}
		recorded <- s.store.ReplaceSandbox(poolID, rec)
	}()

	log := s.log.With("sandbox_id", rec.ID, "request_id", req.RequestID, "pool_entry", poolID)
	t := newTask(s.store, e, rec, tmpl)
	timings := []workflow.Timing{{Step: 1, Action: "claim", Phase: workflow.PhaseDo, Duration: claimed.Sub(begin)}}
	step := func(name string, fn func() error) error {
		b := time.Now()
		err := fn()
		tm := workflow.Timing{Step: len(timings) + 1, Action: name, Phase: workflow.PhaseDo, Duration: time.Since(b)}
		if err != nil {
			tm.Err = err.Error()
		}
		timings = append(timings, tm)
		return err
	}
	applyErr := s.node.ApplyClaim(ctx, t, prev, step)
	// "record" is what the claim still waited for the write, not the
	// write's own time.
	if err := step("record", func() error { return <-recorded }); err != nil {
		// The entry's record stands and names the resources: the entry,
		// perhaps thawed already, is destroyed under it, never returned
		// to the pool.
		s.mu.Lock()
		delete(s.boxes, rec.ID)
		s.boxes[poolID] = old
		s.mu.Unlock()
		old.release()
		log.Warn("warm pool: claim's record write failed; destroying the entry and creating cold", "err", err)
		go func() { _ = s.destroyPoolEntry(s.life, poolID) }()
		return nil, false, nil
	}
	old.release() // nobody finds it any more
	if applyErr != nil {
		log.Warn("warm pool: claim failed; destroying the entry and creating cold", "err", applyErr)
		s.undoClaim(ctx, t, log, applyErr)
		return nil, false, nil
	}
	if err := failpoint.Eval(ctx, FailpointClaimRunning); err != nil {
		s.undoClaim(ctx, t, log, err)
		return nil, false, nil
	}
	// The record written above (creating, with the entry's token) already
	// stands for this sandbox: a restart finishes the claim it names
	// (finishClaim). So the running record is written in the background,
	// off the create's path (a later synchronous write supersedes it).
	if err := t.UpdateLazy(func(r *sandbox.Record) { r.State, r.PoolToken = lifecycle.Running, "" }); err != nil {
		return nil, true, err
	}
	snap := t.Record()
	log.Info("sandbox created from warm pool", "duration", time.Since(begin))
	for _, w := range warnings {
		log.Warn(w)
	}
	return &Result{Sandbox: snap, Timings: timings, Pooled: true, Warm: warm, Warnings: warnings}, true, nil
}

// finishClaim completes a claim a restart cut short after its record was
// written (state creating, PoolToken set): the claim's steps are run
// again, each setting what it sets (limits always, where the runtime can
// change them: whether the first run got to them is unknown), and the
// sandbox is recorded running. The reinit is first tried with the entry's
// token; an agent that refuses it was re-initialised already (the token is
// the last thing a reinit changes), and gets it again with its own. An
// error leaves the record for reconcile to undo as a create cut short.
func (s *Service) finishClaim(ctx context.Context, t *actions.Task) error {
	rec := t.Record()
	tmpl, err := s.store.GetTemplate(rec.TemplateID)
	if err != nil {
		return err
	}
	t.Template = tmpl
	d, err := s.node.Driver(rec.Runtime)
	if err != nil {
		return err
	}
	prev := rec.Clone()
	if _, ok := d.(runtime.LimitUpdater); ok {
		prev.Resources = sandbox.Resources{DiskMiB: rec.Resources.DiskMiB}
	}
	run := func(_ string, fn func() error) error { return fn() }
	prev.AccessToken = rec.PoolToken
	if err := s.node.ApplyClaim(ctx, t, prev, run); err != nil {
		prev.AccessToken = rec.AccessToken
		if err2 := s.node.ApplyClaim(ctx, t, prev, run); err2 != nil {
			return fmt.Errorf("finish claim: %w (with the sandbox's own token: %w)", err, err2)
		}
	}
	return t.Update(func(r *sandbox.Record) { r.State, r.PoolToken = lifecycle.Running, "" })
}

// undoClaim destroys a claimed entry whose claim failed, like a failed
// create, so the caller's cold create can take the ID.
func (s *Service) undoClaim(ctx context.Context, t *actions.Task, log interface {
	Error(string, ...any)
}, cause error) {
	_ = t.Update(func(r *sandbox.Record) { r.State = lifecycle.Destroying })
	if _, err := s.engine.Run(context.WithoutCancel(ctx), FlowDestroy, t); err != nil {
		log.Error("warm pool: undo claim; journalled for cleanup", "err", err, "cause", cause)
		_ = t.Update(func(r *sandbox.Record) { r.Error = cause.Error() })
		s.journal(t.Record().ID, err)
		return
	}
	if err := s.store.FinishDestroy(t.Record().ID); err != nil {
		s.journal(t.Record().ID, err)
		return
	}
	s.forget(t.Record().ID)
}

// Pools reports every template's pool.
func (s *Service) Pools() []PoolStats {
	p := s.pool
	if p == nil {
		return nil
	}
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	ids := map[string]bool{}
	for _, m := range []map[string]uint64{p.hits, p.misses, p.refills, p.refillErrors} {
		for id := range m {
			ids[id] = true
		}
	}
	for id := range p.ready {
		ids[id] = true
	}
	out := make([]PoolStats, 0, len(ids))
	for id := range ids {
		out = append(out, PoolStats{
			TemplateID: id, Ready: len(p.ready[id]), Filling: p.filling[id], Target: p.target(id, now),
			Hits: p.hits[id], Misses: p.misses[id], Refills: p.refills[id], Errs: p.refillErrors[id],
		})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].TemplateID < out[j].TemplateID })
	return out
}

// PoolReady is the number of ready entries of template id.
func (s *Service) PoolReady(id string) int {
	p := s.pool
	if p == nil {
		return 0
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.ready[id])
}

// poolCollector exports the pools at scrape time.
type poolCollector struct{ p *warmPool }

var _ prometheus.Collector = (*poolCollector)(nil)

var (
	poolEntriesDesc = prometheus.NewDesc("cubelet_warm_pool_ready",
		"Frozen sandboxes ready for creates to claim.", []string{"template"}, nil)
	poolTargetDesc = prometheus.NewDesc("cubelet_warm_pool_target",
		"Entries the pool is kept at now (configured size grown by the recent create rate).", []string{"template"}, nil)
	poolFillingDesc = prometheus.NewDesc("cubelet_warm_pool_filling",
		"Entries the refiller is making now.", []string{"template"}, nil)
	poolClaimsDesc = prometheus.NewDesc("cubelet_warm_pool_claims_total",
		"Creates that asked the pool for an entry, by result (hit: served from it, miss: empty, created cold).", []string{"template", "result"}, nil)
	poolRefillsDesc = prometheus.NewDesc("cubelet_warm_pool_refills_total",
		"Entries the refiller started, by result.", []string{"template", "result"}, nil)
)

func (c *poolCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- poolEntriesDesc
	ch <- poolTargetDesc
	ch <- poolFillingDesc
	ch <- poolClaimsDesc
	ch <- poolRefillsDesc
}

func (c *poolCollector) Collect(ch chan<- prometheus.Metric) {
	for _, st := range c.p.s.Pools() {
		ch <- prometheus.MustNewConstMetric(poolEntriesDesc, prometheus.GaugeValue, float64(st.Ready), st.TemplateID)
		ch <- prometheus.MustNewConstMetric(poolTargetDesc, prometheus.GaugeValue, float64(st.Target), st.TemplateID)
		ch <- prometheus.MustNewConstMetric(poolFillingDesc, prometheus.GaugeValue, float64(st.Filling), st.TemplateID)
		ch <- prometheus.MustNewConstMetric(poolClaimsDesc, prometheus.CounterValue, float64(st.Hits), st.TemplateID, "hit")
		ch <- prometheus.MustNewConstMetric(poolClaimsDesc, prometheus.CounterValue, float64(st.Misses), st.TemplateID, "miss")
		ch <- prometheus.MustNewConstMetric(poolRefillsDesc, prometheus.CounterValue, float64(st.Refills), st.TemplateID, "ok")
		ch <- prometheus.MustNewConstMetric(poolRefillsDesc, prometheus.CounterValue, float64(st.Errs), st.TemplateID, "error")
	}
}
