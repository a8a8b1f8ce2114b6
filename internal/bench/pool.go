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

// PoolTemplate is the template a private node keeps a warm pool for.
func PoolTemplate(tmpl string) string { return tmpl + "-pool" }

// poolTOML is the private node's warm pool config.
func poolTOML(o report.Options) string {
	return fmt.Sprintf("\n[warm_pool]\nrefill_interval = \"0s\"\n[warm_pool.templates]\n%q = %d\n", PoolTemplate(o.Template), poolSize)
}

// poolTemplate is the run's pool template, imported once.
type poolTemplate struct {
	once sync.Once
	id   string
	err  error
}

func (e *Env) poolTmpl(ctx context.Context) (string, error) {
	p := &e.poolT
	p.once.Do(func() {
		if e.node == nil || e.Opts.ImageLayout == "" {
			p.err = skipf("create-pool needs a private node (its config keeps the pool)")
			return
		}
		id := PoolTemplate(e.Opts.Template)
		e.Progress.Note("importing template %s (warm pool of %d)", id, poolSize)
		if err := importTemplate(ctx, e.Client, id, e.Opts.ImageLayout); err != nil {
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
	return nil
}

// waitPool waits (untimed) until template id has a ready pool entry.
func (e *Env) waitPool(ctx context.Context, id string) error {
	deadline := time.Now().Add(time.Minute)
	for {
		r, err := e.Client.GetTemplate(ctx, &pb.GetTemplateRequest{TemplateId: id})
		if err != nil {
			return err
		}
		if r.Template.PoolReady > 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("template %s: no warm pool entry after a minute", id)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func poolRuntime(_ context.Context, e *Env) error {
	if e.Opts.Runtime != "" && e.Opts.Runtime != "runc" {
		return skipf("warm pools are kept for runc only (run with --runtime runc)")
	}
	if e.node == nil {
		return skipf("create-pool needs a private node (its config keeps the pool)")
	}
	return nil
}

func init() {
	Register(Scenario{
		Name: "create-pool", Kind: report.KindCube,
		Help:      "create-to-ready claiming a frozen sandbox of the template's warm pool (waits untimed for the refill between samples)",
		Baselines: []string{"runc-run"},
		Params:    func(o report.Options) report.Params { return report.Params{N: o.N1, Concurrency: 1} },
		Probe:     poolRuntime,
		Run:       runCreatePool,
	})
}

func runCreatePool(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
	id, err := e.poolTmpl(ctx)
	if err != nil {
		return nil, err
	}
	var at report.ActionTimes
	e.Progress.Start("create-pool", p.N)
	d := drive(ctx, e.Progress, p.N, 1, func(ctx context.Context, _ int) (time.Duration, error) {
		if err := e.waitPool(ctx, id); err != nil {
			return 0, err
		}
		start := time.Now()
		resp, err := e.Client.CreateSandbox(ctx, &pb.CreateSandboxRequest{
			TemplateId: id, Runtime: e.Opts.Runtime, Labels: map[string]string{LabelKey: e.RunID},
		})
		dur := time.Since(start)
		if err != nil {
			return 0, fmt.Errorf("create: %w", err)
		}
		derr := e.deleteAll(ctx, "", []string{resp.Sandbox.Id}, 1)
		if !resp.Pooled {
			return 0, errors.Join(fmt.Errorf("create of %s was not served from the warm pool", resp.Sandbox.Id), derr)
		}
		addTimings(&at, resp.Timings)
		return dur, derr
	})
	e.Progress.Finish()
	r, err := d.result("create-pool", report.KindCube, p)
	if r != nil {
		r.Acts = &at
		r.Notes = append(r.Notes, fmt.Sprintf("pool of %d entries per template; each sample waits (untimed) for a ready entry", poolSize))
	}
	return r, err
}
