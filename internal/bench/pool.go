package bench

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/bench/report"
)

// Warm pools: a private node keeps a pool for PoolTemplate(template), a
// copy of the run's template imported by the create-pool scenario (so the
// cold create scenarios of the same run keep starting containers).

// poolSize is the private node's pool for the pool template: enough that
// back-to-back samples find an entry while the refiller replaces the last.
const poolSize = 2

// PoolTemplate is the template a private node keeps a warm pool of
// poolSize for; BurstPoolTemplate the one it keeps a pool of
// --concurrency for (create-pool-c50).
func PoolTemplate(tmpl string) string      { return tmpl + "-pool" }
func BurstPoolTemplate(tmpl string) string { return tmpl + "-pool-burst" }

// poolTOML is the private node's warm pool config.
func poolTOML(o report.Options) string {
	return fmt.Sprintf("\n[warm_pool]\nrefill_interval = \"0s\"\nmax = %d\n[warm_pool.templates]\n%q = %d\n%q = %d\n",
		max(o.Concurrency, poolSize), PoolTemplate(o.Template), poolSize, BurstPoolTemplate(o.Template), o.Concurrency)
}

// poolTemplate is one of the run's pool templates, imported once.
type poolTemplate struct {
	once sync.Once
	id   string
	err  error
}

func (e *Env) poolTmpl(ctx context.Context) (string, error) {
	return e.importPoolTemplate(ctx, &e.poolT, PoolTemplate(e.Opts.Template), poolSize)
}

func (e *Env) importPoolTemplate(ctx context.Context, p *poolTemplate, id string, size int) (string, error) {
	p.once.Do(func() {
		if e.node == nil || e.Opts.ImageLayout == "" {
			p.err = skipf("create-pool needs a private node (its config keeps the pool)")
			return
		}
		e.Progress.Note("importing template %s (warm pool of %d)", id, size)
		if e.Opts.Runtime == "vm" {
			// Imported for vm (a template of the node's default
			// runtime would fill a runc pool first), then warmed: a VM
			// template keeps a pool only while warm, its entries being
			// clones of the warm snapshot.
			if err := importTemplateOn(ctx, e.Client, id, e.Opts.ImageLayout, "vm"); err != nil {
				p.err = err
				return
			}
			p.id = id
			e.Progress.Note("warming template %s on vm (its pool's entries are clones of it)", id)
			if _, err := e.Client.WarmTemplate(ctx, &pb.WarmTemplateRequest{TemplateId: id, Runtime: "vm"}); err != nil {
				p.err = fmt.Errorf("warm pool template %s: %w", id, err)
			}
			return
		}
		var err error
		if e.Opts.Runtime == "gvisor" {
			// Imported for gvisor, so that its pool's entries are
			// gVisor sandboxes (frozen with runsc pause).
			err = importTemplateOn(ctx, e.Client, id, e.Opts.ImageLayout, "gvisor")
		} else {
			err = importTemplate(ctx, e.Client, id, e.Opts.ImageLayout)
		}
		if err != nil {
			p.err = err
			return
		}
		p.id = id
	})
	return p.id, p.err
}

// close deletes the pool template, which drains its pool.
func (p *poolTemplate) close(ctx context.Context, c pb.CubeletServiceClient) error {
	if p.id == "" {
		return nil
	}
	if _, err := c.DeleteTemplate(context.WithoutCancel(ctx), &pb.DeleteTemplateRequest{TemplateId: p.id}); err != nil {
		return fmt.Errorf("delete pool template %s: %w", p.id, err)
	}
	p.id = ""
	return nil
}

// closePools deletes the run's pool templates, draining their pools: the
// pool entries are the node's, kept between the pool scenarios' chunks,
// and go with the run.
func (e *Env) closePools(ctx context.Context) error {
	if e.Client == nil {
		return nil
	}
	return errors.Join(e.poolT.close(ctx, e.Client), e.poolBurstT.close(ctx, e.Client))
}

// waitPool waits (untimed) until template id has n ready pool entries.
func (e *Env) waitPool(ctx context.Context, id string, n int) error {
	deadline := time.Now().Add(5 * time.Minute)
	for {
		r, err := e.Client.GetTemplate(ctx, &pb.GetTemplateRequest{TemplateId: id})
		if err != nil {
			return err
		}
		if int(r.Template.PoolReady) >= n {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("template %s: fewer than %d warm pool entries after 5 minutes", id, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitRefilled waits until template id's pool is at its target with no
// entry in the making (cubelet_warm_pool_{ready,target,filling}): the
// refiller then starts none until a create takes one, so the create that
// follows shares the node with no refill.
func (e *Env) waitRefilled(ctx context.Context, id string) error {
	deadline := time.Now().Add(5 * time.Minute)
	for {
		v, err := e.metrics(ctx, fmt.Sprintf("cubelet_warm_pool_ready{template=%q}", id),
			fmt.Sprintf("cubelet_warm_pool_target{template=%q}", id), fmt.Sprintf("cubelet_warm_pool_filling{template=%q}", id))
		if err != nil {
			return err
		}
		if v[0] >= v[1] && v[2] == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("template %s: pool not refilled after 5 minutes (ready %v, target %v, filling %v)", id, v[0], v[1], v[2])
		}
		// Not faster: each scrape is CPU of the node under test.
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(25 * time.Millisecond):
		}
	}
}

func poolRuntime(_ context.Context, e *Env) error {
	if e.node == nil {
		return skipf("create-pool needs a private node (its config keeps the pool)")
	}
	return nil
}

func init() {
	Register(Scenario{
		Name: "create-pool", Kind: report.KindCube,
		Help:      "create-to-ready claiming a frozen sandbox of the template's warm pool (waits untimed for the refill between samples)",
		Baselines: []string{"runc-run", "runsc-restore", "qemu-incoming", "qemu-incoming-full"},
		Params:    func(o report.Options) report.Params { return report.Params{N: o.N1, Concurrency: 1} },
		Probe:     poolRuntime,
		Run:       runCreatePool,
	})
	Register(Scenario{
		Name: "create-pool-sustained", Kind: report.KindCube,
		Help:      "--n-c50 creates with --concurrency in flight from a warm pool of --concurrency that drains (full at the start, refilled only while no create is in flight; --max-live >= --n-c50 to keep it from refilling between rounds)",
		Baselines: []string{"runc-run"},
		Params:    func(o report.Options) report.Params { return report.Params{N: o.N50, Concurrency: o.Concurrency} },
		Probe:     poolRuntime,
		Whole:     true,
		Run:       runCreatePoolSustained,
	})
	Register(Scenario{
		Name: "create-pool-c50", Kind: report.KindCube,
		Help:      "bursts of --concurrency creates at once, each burst served from a warm pool of --concurrency (refilled, untimed, between bursts)",
		Baselines: []string{"runc-run"},
		Params:    func(o report.Options) report.Params { return report.Params{N: o.N50, Concurrency: o.Concurrency} },
		Probe:     poolRuntime,
		Run:       runCreatePoolBurst,
	})
}

// createPooled times one create of template id and deletes it
// (untimed); a create the pool did not serve is a failure.
func (e *Env) createPooled(ctx context.Context, id string, at *report.ActionTimes, mu *sync.Mutex, made *[]string) (time.Duration, error) {
	sb, dur, pooled, err := e.createFrom(ctx, id, at, mu, made)
	if err == nil && !pooled {
		return 0, fmt.Errorf("create of %s was not served from the warm pool", sb)
	}
	return dur, err
}

// createFrom times one create of template id, served from its pool or
// not (pooled says which), and adds the sandbox (sb) to made.
func (e *Env) createFrom(ctx context.Context, id string, at *report.ActionTimes, mu *sync.Mutex, made *[]string) (sb string, dur time.Duration, pooled bool, err error) {
	start := time.Now()
	resp, err := e.Client.CreateSandbox(ctx, &pb.CreateSandboxRequest{
		TemplateId: id, Runtime: e.Opts.Runtime, Labels: map[string]string{LabelKey: e.RunID},
	})
	dur = time.Since(start)
	if err != nil {
		return "", 0, false, fmt.Errorf("create: %w", err)
	}
	mu.Lock()
	*made = append(*made, resp.Sandbox.Id)
	addTimings(at, resp.Timings)
	mu.Unlock()
	return resp.Sandbox.Id, dur, resp.Pooled, nil
}

// runCreatePoolSustained is create-c50 against a warm pool that drains:
// the pool of --concurrency is full when the first create starts, and
// the refiller makes an entry only while no create is in flight, so once
// the pool is empty creates are cold. It creates in rounds of --max-live,
// as runc-run does; the pool refills between rounds (untimed, while the
// round's sandboxes are destroyed), so with --max-live >= --n-c50 (both
// sides keep every sandbox up) it drains once.
func runCreatePoolSustained(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
	id, err := e.importPoolTemplate(ctx, &e.poolBurstT, BurstPoolTemplate(e.Opts.Template), e.Opts.Concurrency)
	if err != nil {
		return nil, err
	}
	if err := e.waitPool(ctx, id, e.Opts.Concurrency); err != nil {
		return nil, err
	}
	var (
		at             report.ActionTimes
		mu             sync.Mutex
		all            driveResult
		pooled, served int
	)
	rs := rounds(p.N, e.Opts.MaxLive)
	for ri, n := range rs {
		var made []string
		e.Progress.Start("create-pool-sustained", n)
		d := drive(ctx, e.Progress, n, p.Concurrency, func(ctx context.Context, _ int) (time.Duration, error) {
			_, dur, fromPool, err := e.createFrom(ctx, id, &at, &mu, &made)
			if fromPool {
				mu.Lock()
				pooled++
				mu.Unlock()
			}
			return dur, err
		})
		e.Progress.Finish()
		if ri == 0 {
			e.peak(ctx)
		}
		all.merge(d)
		served += len(made)
		if err := e.deleteAll(ctx, "cleanup", made, p.Concurrency); err != nil {
			return nil, err
		}
		if err := ctx.Err(); err != nil {
			return nil, err
		}
	}
	r, err := all.result("create-pool-sustained", report.KindCube, p)
	if r != nil {
		r.Acts = &at
		r.Notes = append(r.Notes, fmt.Sprintf("served from the warm pool: %d of %d (pool of %d, full at the start, refilled only while no create is in flight); %d round(s) of at most %d live sandboxes (--max-live), the pool refilled between them",
			pooled, served, e.Opts.Concurrency, len(rs), e.Opts.MaxLive))
	}
	return r, err
}

func runCreatePoolBurst(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
	id, err := e.importPoolTemplate(ctx, &e.poolBurstT, BurstPoolTemplate(e.Opts.Template), e.Opts.Concurrency)
	if err != nil {
		return nil, err
	}
	var (
		at  report.ActionTimes
		mu  sync.Mutex
		all driveResult
	)
	e.Progress.Start("create-pool-c50", p.N)
	for _, n := range rounds(p.N, p.Concurrency) {
		if err := e.waitPool(ctx, id, n); err != nil {
			return nil, err
		}
		var made []string
		d := drive(ctx, e.Progress, n, n, func(ctx context.Context, _ int) (time.Duration, error) {
			return e.createPooled(ctx, id, &at, &mu, &made)
		})
		all.merge(d)
		if err := e.deleteAll(ctx, "", made, 8); err != nil {
			return nil, err
		}
	}
	e.Progress.Finish()
	r, err := all.result("create-pool-c50", report.KindCube, p)
	if r != nil {
		r.Acts = &at
		r.Notes = append(r.Notes, fmt.Sprintf("bursts of %d creates at once, each from a full pool of %d (refill between bursts untimed)", p.Concurrency, e.Opts.Concurrency))
	}
	return r, err
}

func runCreatePool(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
	id, err := e.poolTmpl(ctx)
	if err != nil {
		return nil, err
	}
	var at report.ActionTimes
	e.Progress.Start("create-pool", p.N)
	var mu sync.Mutex
	d := drive(ctx, e.Progress, p.N, 1, func(ctx context.Context, _ int) (time.Duration, error) {
		if err := e.waitPool(ctx, id, 1); err != nil {
			return 0, err
		}
		if err := e.waitRefilled(ctx, id); err != nil {
			return 0, err
		}
		var made []string
		dur, err := e.createPooled(ctx, id, &at, &mu, &made)
		return dur, errors.Join(err, e.deleteAll(ctx, "", made, 1))
	})
	e.Progress.Finish()
	r, err := d.result("create-pool", report.KindCube, p)
	if r != nil {
		r.Acts = &at
		r.Notes = append(r.Notes, fmt.Sprintf("pool of %d entries per template; each sample waits (untimed) for a ready entry and for the refiller to finish the entry it is making, so that a claim does not share the cores with a refill (a VM's refill is a restore: hundreds of ms of CPU under TCG)", poolSize))
	}
	return r, err
}

// importTemplateOn is importTemplate for template id on runtime rt.
func importTemplateOn(ctx context.Context, c pb.CubeletServiceClient, id, source, rt string) error {
	st, err := c.ImportTemplate(ctx, &pb.ImportTemplateRequest{TemplateId: id, Source: source, Runtime: rt})
	if err != nil {
		return err
	}
	for {
		ev, err := st.Recv()
		if err != nil {
			return fmt.Errorf("import template %s: %w", id, err)
		}
		if ev.GetTemplate() != nil {
			return nil
		}
	}
}
