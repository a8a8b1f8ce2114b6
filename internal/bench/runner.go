package bench

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
)

// Report is one run of cube-bench: what ran, where, and what came out.
type Report struct {
	RunID    string    `json:"run_id"`
	Command  string    `json:"command"`
	Started  time.Time `json:"started"`
	Finished time.Time `json:"finished"`
	Machine  Machine   `json:"machine"`
	Options  Options   `json:"options"`
	Results  []*Result `json:"results"`
	Targets  []Target  `json:"targets"`
	Notes    []string  `json:"notes,omitempty"`
}

// Run runs the scenarios in order. Before each cube scenario it runs that
// scenario's baselines (those of the runtime in use, each once per set of
// Params), and compares. A failing or skipped scenario is reported and the
// run goes on; only ctx ending stops it.
func Run(ctx context.Context, e *Env, list []*Scenario) *Report {
	rep := &Report{RunID: e.RunID, Started: time.Now().UTC(), Options: e.Opts}
	rep.Machine = DescribeMachine(ctx, e)
	cache := map[string]*Result{}
	rt := e.Opts.Runtime
	if rt == "" {
		rt = "runc"
	}
	for _, s := range list {
		if ctx.Err() != nil {
			break
		}
		p := s.Params(e.Opts)
		if s.Kind == KindBaseline {
			r := runOne(ctx, e, s, p)
			cache[cacheKey(s.Name, p)] = r
			rep.Results = append(rep.Results, r)
			continue
		}
		if s.Probe != nil {
			if err := s.Probe(ctx, e); err != nil {
				rep.Results = append(rep.Results, failed(s, p, err))
				e.Progress.Note("%s: %s", s.Name, err)
				continue
			}
		}
		var bases []*Result
		for _, bn := range s.Baselines {
			b, ok := Lookup(bn)
			if !ok || e.Opts.NoBaselines || (b.Runtime != "" && b.Runtime != rt) {
				continue
			}
			bp := p
			if e.Opts.BaselineN > 0 && bp.N > e.Opts.BaselineN {
				bp.N = e.Opts.BaselineN
			}
			r, ok := cache[cacheKey(bn, bp)]
			if !ok {
				r = runOne(ctx, e, b, bp)
				cache[cacheKey(bn, bp)] = r
				rep.Results = append(rep.Results, r)
			}
			bases = append(bases, r)
		}
		var prof *profiler
		if e.Opts.ProfileDir != "" {
			var err error
			if e.MetricsURL == "" {
				err = errors.New("cubelet's metrics address is unknown (--metrics-addr)")
			} else {
				prof, err = startProfiler(ctx, e.MetricsURL, filepath.Join(e.Opts.ProfileDir, s.Name), e.Opts.ProfileWindow)
			}
			if err != nil {
				rep.Notes = append(rep.Notes, fmt.Sprintf("%s: no profile: %v", s.Name, err))
			}
		}
		e.profiler = prof
		r := runOne(ctx, e, s, p)
		e.profiler = nil
		if prof != nil {
			files, err := prof.finish(ctx)
			r.Profiles = files
			if err != nil {
				r.Notes = append(r.Notes, "profile: "+err.Error())
			}
		}
		for _, b := range bases {
			r.Compare = append(r.Compare, compare(r, b))
		}
		rep.Results = append(rep.Results, r)
	}
	if n, err := e.sweep(ctx); err != nil || n > 0 {
		rep.Notes = append(rep.Notes, fmt.Sprintf("swept %d sandboxes a scenario left behind (err: %v)", n, err))
	}
	rep.Finished = time.Now().UTC()
	rep.Machine.LoadEnd = loadAvg()
	rep.Targets = Evaluate(rep)
	return rep
}

func cacheKey(name string, p Params) string { return fmt.Sprintf("%s/%d/%d", name, p.N, p.Concurrency) }

func runOne(ctx context.Context, e *Env, s *Scenario, p Params) *Result {
	if s.Probe != nil {
		if err := s.Probe(ctx, e); err != nil {
			e.Progress.Note("%s: %s", s.Name, err)
			return failed(s, p, err)
		}
	}
	r, err := s.Run(ctx, e, p)
	if err != nil {
		e.Progress.Note("%s: %s", s.Name, err)
		return failed(s, p, err)
	}
	r.Scenario, r.Kind, r.Params = s.Name, s.Kind, p
	return r
}

// failed is the Result of a scenario that was skipped or failed.
func failed(s *Scenario, p Params, err error) *Result {
	r := &Result{Scenario: s.Name, Kind: s.Kind, Params: p}
	if errors.Is(err, ErrSkip) {
		r.Skipped = err.Error()
	} else {
		r.Error = err.Error()
	}
	return r
}

// sweep deletes every sandbox labelled with this run's ID: a safety net
// behind scenarios, which clean up themselves.
func (e *Env) sweep(ctx context.Context) (int, error) {
	ctx = context.WithoutCancel(ctx)
	resp, err := e.Client.ListSandboxes(ctx, &pb.ListSandboxesRequest{Labels: map[string]string{LabelKey: e.RunID}})
	if err != nil {
		return 0, err
	}
	var ids []string
	for _, s := range resp.Sandboxes {
		ids = append(ids, s.Id)
	}
	return len(ids), e.deleteAll(ctx, "sweep", ids, 4)
}
