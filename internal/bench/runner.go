package bench

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/bench/report"
)

// Run runs the scenarios in order. Each cube scenario runs interleaved
// with its baselines (those of the runtime in use, each once per set of
// Params) and is compared with them. A failing or skipped scenario is reported and the
// run goes on; only ctx ending stops it.
func Run(ctx context.Context, e *Env, list []*Scenario) *report.Report {
	rep := &report.Report{RunID: e.RunID, Started: time.Now().UTC(), Options: e.Opts}
	rep.Machine = DescribeMachine(ctx, e)
	cache := map[string]*report.Result{}
	rt := e.Opts.Runtime
	if rt == "" {
		rt = "runc"
	}
	for _, s := range list {
		if ctx.Err() != nil {
			break
		}
		p := s.Params(e.Opts)
		if s.Kind == report.KindBaseline {
			r := runOne(ctx, e, s, p)
			cache[cacheKey(s.Name, p)] = r
			rep.Results = append(rep.Results, r)
			continue
		}
		runCube(ctx, e, s, p, rt, cache, rep)
	}
	if n, err := e.sweep(ctx); err != nil || n > 0 {
		rep.Notes = append(rep.Notes, fmt.Sprintf("swept %d sandboxes a scenario left behind (err: %v)", n, err))
	}
	rep.Finished = time.Now().UTC()
	rep.Machine.LoadEnd = loadAvg()
	rep.Targets = report.Evaluate(rep)
	return rep
}

// runCube runs a cube scenario with its baselines and appends the results
// (and the baselines measured for it) to rep. cache holds the baselines
// measured so far, by name and Params.
func runCube(ctx context.Context, e *Env, s *Scenario, p report.Params, rt string, cache map[string]*report.Result, rep *report.Report) {
	if s.Probe != nil {
		if err := s.Probe(ctx, e); err != nil {
			rep.Results = append(rep.Results, failed(s, p, err))
			e.Progress.Note("%s: %s", s.Name, err)
			return
		}
	}
	// This runtime's baselines: measured with the same Params (N capped
	// by BaselineN) unless an earlier scenario already did.
	type pending struct {
		s     *Scenario
		p     report.Params
		parts []*report.Result
	}
	var fresh []*pending
	var bases []string
	for _, bn := range s.Baselines {
		b, ok := Lookup(bn)
		if !ok || e.Opts.NoBaselines || (b.Runtime != "" && b.Runtime != rt) {
			continue
		}
		bp := p
		if e.Opts.BaselineN > 0 && bp.N > e.Opts.BaselineN {
			bp.N = e.Opts.BaselineN
		}
		bases = append(bases, cacheKey(bn, bp))
		if _, ok := cache[cacheKey(bn, bp)]; ok {
			continue
		}
		if b.Probe != nil {
			if err := b.Probe(ctx, e); err != nil {
				e.Progress.Note("%s: %s", b.Name, err)
				r := failed(b, bp, err)
				cache[cacheKey(bn, bp)] = r
				rep.Results = append(rep.Results, r)
				continue
			}
		}
		fresh = append(fresh, &pending{s: b, p: bp})
	}
	// Baselines and the scenario run in alternating chunks, so a
	// shared machine's load swings hit both sides alike and the
	// ratios hold even when absolute times drift.
	chunks := []int{p.N}
	if len(fresh) > 0 && !s.Whole {
		chunks = split(p.N, e.Opts.Chunks)
	}
	prof := e.startProfile(ctx, s.Name, rep)
	var ours []*report.Result
	for i, n := range chunks {
		for _, f := range fresh {
			if bn := spread(f.p.N, len(chunks))[i]; bn > 0 {
				f.parts = append(f.parts, runPart(ctx, e, f.s, report.Params{N: bn, Concurrency: f.p.Concurrency}))
			}
		}
		r := runPart(ctx, e, s, report.Params{N: n, Concurrency: p.Concurrency})
		ours = append(ours, r)
		if r.Error != "" || r.Skipped != "" || ctx.Err() != nil {
			break
		}
	}
	e.profiler = nil
	for _, f := range fresh {
		r := report.Merge(f.s.Name, f.s.Kind, f.p, f.parts)
		r.Finish()
		cache[cacheKey(f.s.Name, f.p)] = r
		rep.Results = append(rep.Results, r)
	}
	r := ours[0]
	if len(ours) > 1 {
		r = report.Merge(s.Name, s.Kind, p, ours)
	}
	r.Params = p
	if s.Finish != nil && r.Error == "" && r.Skipped == "" {
		s.Finish(e, r)
	}
	r.Finish()
	if prof != nil {
		files, err := prof.finish(ctx)
		r.Profiles = files
		if err != nil {
			r.Notes = append(r.Notes, "profile: "+err.Error())
		}
	}
	for _, k := range bases {
		r.Compare = append(r.Compare, report.Compare(r, cache[k]))
	}
	rep.Results = append(rep.Results, r)
}

func cacheKey(name string, p report.Params) string {
	return fmt.Sprintf("%s/%d/%d", name, p.N, p.Concurrency)
}

func runOne(ctx context.Context, e *Env, s *Scenario, p report.Params) *report.Result {
	if s.Probe != nil {
		if err := s.Probe(ctx, e); err != nil {
			e.Progress.Note("%s: %s", s.Name, err)
			return failed(s, p, err)
		}
	}
	r := runPart(ctx, e, s, p)
	r.Finish()
	return r
}

// runPart runs s once with p (already probed).
func runPart(ctx context.Context, e *Env, s *Scenario, p report.Params) *report.Result {
	if err := ctx.Err(); err != nil {
		return failed(s, p, err)
	}
	r, err := s.Run(ctx, e, p)
	if err != nil {
		e.Progress.Note("%s: %s", s.Name, err)
		return failed(s, p, err)
	}
	r.Scenario, r.Kind, r.Params = s.Name, s.Kind, p
	return r
}

// split divides n into k near-equal parts (k <= 1, or k > n: fewer parts
// of at least one, except that n == 0 gives one part of zero).
func split(n, k int) []int {
	if k < 1 {
		k = 1
	}
	if k > n {
		k = max(n, 1)
	}
	out := make([]int, k)
	for i := range out {
		out[i] = n / k
		if i < n%k {
			out[i]++
		}
	}
	return out
}

// spread divides n samples over exactly k chunks as evenly as they go,
// spacing the chunks that get one when n < k (a baseline capped by
// --baseline-n below the scenario's chunk count runs in every other
// chunk, say, rather than only in the first ones).
func spread(n, k int) []int {
	k = max(k, 1)
	out := make([]int, k)
	for i := range out {
		out[i] = (i+1)*n/k - i*n/k
	}
	return out
}

// startProfile starts capturing cubelet's profiles for scenario name when
// --profile is on; nil otherwise (a reason goes to the report's notes).
func (e *Env) startProfile(ctx context.Context, name string, rep *report.Report) *profiler {
	if e.Opts.ProfileDir == "" {
		return nil
	}
	if e.MetricsURL == "" {
		rep.Notes = append(rep.Notes, name+": no profile: cubelet's metrics address is unknown (--metrics-addr)")
		return nil
	}
	prof, err := startProfiler(ctx, e.MetricsHTTP, e.MetricsURL, filepath.Join(e.Opts.ProfileDir, name), e.Opts.ProfileWindow)
	if err != nil {
		rep.Notes = append(rep.Notes, fmt.Sprintf("%s: no profile: %v", name, err))
		return nil
	}
	e.profiler = prof
	return prof
}

// failed is the Result of a scenario that was skipped or failed.
func failed(s *Scenario, p report.Params, err error) *report.Result {
	r := &report.Result{Scenario: s.Name, Kind: s.Kind, Params: p}
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
