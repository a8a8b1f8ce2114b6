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

// LabelKey marks every sandbox the bench creates (value: the run's ID),
// so a run can find and remove what an interrupted scenario left.
const LabelKey = "cube-bench"

// create makes one sandbox and returns its ID and how long CreateSandbox
// took: cubelet answers once the agent inside answers /health, so this is
// create-to-ready as a client sees it. The flow's action timings go to at
// (which may be nil).
func (e *Env) create(ctx context.Context, at *report.ActionTimes) (string, time.Duration, error) {
	return e.createOf(ctx, e.Opts.Template, false, at)
}

// createOf is create from template tmpl; with warm, a create that was
// not a restore of the template's warm snapshot fails (and is deleted).
func (e *Env) createOf(ctx context.Context, tmpl string, warm bool, at *report.ActionTimes) (string, time.Duration, error) {
	req := &pb.CreateSandboxRequest{
		TemplateId: tmpl,
		Runtime:    e.Opts.Runtime,
		Labels:     map[string]string{LabelKey: e.RunID},
	}
	start := time.Now()
	resp, err := e.Client.CreateSandbox(ctx, req)
	d := time.Since(start)
	if err != nil {
		return "", 0, fmt.Errorf("create: %w", err)
	}
	if warm && !resp.Warm {
		return "", 0, errors.Join(fmt.Errorf("create of %s was not served from the warm snapshot", resp.Sandbox.Id),
			e.deleteAll(ctx, "", []string{resp.Sandbox.Id}, 1))
	}
	addTimings(at, resp.Timings)
	return resp.Sandbox.Id, d, nil
}

// addTimings records the action timings an RPC returned, as
// flow/step/action, in at (nil: dropped).
func addTimings(at *report.ActionTimes, ts []*pb.ActionTiming) {
	if at == nil {
		return
	}
	for _, t := range ts {
		if t.Phase != "" && t.Phase != "do" {
			continue // undo timings belong to failed calls
		}
		at.Add(fmt.Sprintf("%s/%d/%s", t.Flow, t.Step, t.Action), t.Duration.AsDuration())
	}
}

// deleteAll removes sandboxes, c at a time. It runs to the end even when
// ctx is cancelled: a bench that is interrupted must still clean up.
func (e *Env) deleteAll(ctx context.Context, label string, ids []string, c int) error {
	if len(ids) == 0 {
		return nil
	}
	ctx = context.WithoutCancel(ctx)
	prog := e.Progress
	if label == "" {
		prog = nil // inside another phase's bar
	}
	prog.Start(label, len(ids))
	defer prog.Finish()
	d := drive(ctx, prog, len(ids), c, func(ctx context.Context, i int) (time.Duration, error) {
		_, err := e.Client.DeleteSandbox(ctx, &pb.DeleteSandboxRequest{SandboxId: ids[i]})
		return 0, err
	})
	if d.failed > 0 {
		return fmt.Errorf("delete %d of %d sandboxes failed: %w", d.failed, len(ids), errors.Join(d.errs...))
	}
	return nil
}

// fill creates n sandboxes on c workers (untimed setup for other
// scenarios) and returns their IDs. On failure it removes what it made.
func (e *Env) fill(ctx context.Context, label string, n, c int) ([]string, error) {
	return e.fillTimed(ctx, e.Opts.Template, false, label, n, c, nil)
}

// fillTimed is fill from template tmpl (warm as createOf) that also hands
// back the create latencies.
func (e *Env) fillTimed(ctx context.Context, tmpl string, warm bool, label string, n, c int, lat *[]time.Duration) ([]string, error) {
	var (
		mu  sync.Mutex
		ids []string
	)
	e.Progress.Start(label, n)
	d := drive(ctx, e.Progress, n, c, func(ctx context.Context, _ int) (time.Duration, error) {
		id, dur, err := e.createOf(ctx, tmpl, warm, nil)
		if err == nil {
			mu.Lock()
			ids = append(ids, id)
			mu.Unlock()
		}
		return dur, err
	})
	e.Progress.Finish()
	if lat != nil {
		*lat = d.samples
	}
	if err := ctx.Err(); d.failed > 0 || err != nil {
		if d.failed > 0 {
			err = errors.Join(fmt.Errorf("%s: %d of %d creates failed: %w", label, d.failed, n, errors.Join(d.errs...)), err)
		}
		return nil, errors.Join(err, e.deleteAll(ctx, "cleanup", ids, c))
	}
	return ids, nil
}

func init() {
	Register(Scenario{
		Name: "create-c1", Kind: report.KindCube,
		Help:      "create-to-ready (CreateSandbox returns when the agent answers /health), one at a time",
		Baselines: []string{"runc-run", "podman-run"},
		Params:    func(o report.Options) report.Params { return report.Params{N: o.N1, Concurrency: 1} },
		Run:       runCreate("create-c1"),
	})
	Register(Scenario{
		Name: "create-c50", Kind: report.KindCube,
		Help:      "create-to-ready with --concurrency creates in flight (default 50)",
		Baselines: []string{"runc-run"},
		Params:    func(o report.Options) report.Params { return report.Params{N: o.N50, Concurrency: o.Concurrency} },
		Run:       runCreate("create-c50"),
	})
	Register(Scenario{
		Name: "pause", Kind: report.KindCube,
		Help:      "PauseSandbox of a running sandbox (cgroup freezer through the runtime)",
		Baselines: []string{"runc-pause", "freezer-freeze"},
		Params:    func(o report.Options) report.Params { return report.Params{N: o.N1, Concurrency: 1} },
		Run: func(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
			return pauseResume(ctx, e, p, "pause")
		},
	})
	Register(Scenario{
		Name: "resume", Kind: report.KindCube,
		Help:      "ResumeSandbox of a paused sandbox, until its agent answers /health again",
		Baselines: []string{"runc-resume", "freezer-thaw"},
		Params:    func(o report.Options) report.Params { return report.Params{N: o.N1, Concurrency: 1} },
		Run: func(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
			return pauseResume(ctx, e, p, "resume")
		},
	})
	Register(Scenario{
		Name: "destroy", Kind: report.KindCube,
		Help:      "DeleteSandbox of a running sandbox (process, rootfs mount, loop device, disk, record)",
		Baselines: []string{"runc-delete"},
		Params:    func(o report.Options) report.Params { return report.Params{N: o.N1, Concurrency: 1} },
		Run:       runDestroy,
	})
}

// runCreate times creates in rounds of at most MaxLive sandboxes: each
// round's sandboxes stay up until the round ends and are then destroyed
// (untimed) before the next round starts, so creates never overlap
// destroys.
func runCreate(name string) func(context.Context, *Env, report.Params) (*report.Result, error) {
	return func(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
		var all driveResult
		var at report.ActionTimes
		done := 0
		for ri, n := range rounds(p.N, e.Opts.MaxLive) {
			var (
				mu  sync.Mutex
				ids []string
			)
			label := name
			if p.N > n {
				label = fmt.Sprintf("%s %d-%d", name, done+1, done+n)
			}
			e.Progress.Start(label, n)
			d := drive(ctx, e.Progress, n, p.Concurrency, func(ctx context.Context, _ int) (time.Duration, error) {
				id, dur, err := e.create(ctx, &at)
				if err == nil {
					mu.Lock()
					ids = append(ids, id)
					mu.Unlock()
				}
				return dur, err
			})
			e.Progress.Finish()
			if ri == 0 {
				e.peak(ctx)
			}
			all.merge(d)
			if err := e.deleteAll(ctx, "cleanup", ids, p.Concurrency); err != nil {
				return nil, err
			}
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			done += n
		}
		r, err := all.result(name, report.KindCube, p)
		if err != nil {
			return nil, err
		}
		r.Acts = &at
		if len(rounds(p.N, e.Opts.MaxLive)) > 1 {
			r.Notes = append(r.Notes, fmt.Sprintf("created in rounds of at most %d live sandboxes (--max-live)", e.Opts.MaxLive))
		}
		return r, nil
	}
}

// pauseResume cycles one sandbox through pause and resume N times; the
// pause and resume scenarios share the cycles when both run.
func pauseResume(ctx context.Context, e *Env, p report.Params, want string) (*report.Result, error) {
	return pauseCycles(ctx, e, p, want, pauseCycle{pause: "pause", resume: "resume"})
}

// pauseCycle names one way of pausing: the scenarios its pause and resume
// times are remembered under, and the mode asked for (unspecified is
// cubelet's default, memory).
type pauseCycle struct {
	pause, resume string
	mode          pb.PauseMode
}

// pauseCycles cycles one sandbox through pause and resume N times; the
// pause and resume scenarios of a mode share the cycles, so whichever runs
// second reuses the first one's samples.
func pauseCycles(ctx context.Context, e *Env, p report.Params, want string, pc pauseCycle) (*report.Result, error) {
	if b, ok := e.recall(want, p); ok {
		return b.result(want, report.KindCube, p), nil
	}
	ids, err := e.fill(ctx, pc.pause+"/"+pc.resume+": setup", 1, 1)
	if err != nil {
		return nil, err
	}
	id := ids[0]
	var pause, resume []time.Duration
	var pat, rat report.ActionTimes
	e.Progress.Start(pc.pause+"+"+pc.resume, p.N)
	var runErr error
	for i := 0; i < p.N; i++ { // every error breaks out
		start := time.Now()
		presp, err := e.Client.PauseSandbox(ctx, &pb.PauseSandboxRequest{SandboxId: id, Mode: pc.mode})
		if err != nil {
			runErr = fmt.Errorf("%s: %w", pc.pause, err)
			break
		}
		pause = append(pause, time.Since(start))
		addTimings(&pat, presp.Timings)
		start = time.Now()
		rresp, err := e.Client.ResumeSandbox(ctx, &pb.ResumeSandboxRequest{SandboxId: id})
		if err != nil {
			runErr = fmt.Errorf("%s: %w", pc.resume, err)
			break
		}
		resume = append(resume, time.Since(start))
		addTimings(&rat, rresp.Timings)
		e.Progress.Step(true)
	}
	e.Progress.Finish()
	if err := e.deleteAll(ctx, "cleanup", ids, 1); err != nil {
		runErr = errors.Join(runErr, err)
	}
	if runErr != nil {
		return nil, runErr
	}
	e.remember(pc.pause, p, batch{pause, &pat})
	e.remember(pc.resume, p, batch{resume, &rat})
	b, _ := e.recall(want, p)
	return b.result(want, report.KindCube, p), nil
}

// runDestroy creates N sandboxes (untimed) and times deleting each, in
// rounds of at most MaxLive.
func runDestroy(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
	var all driveResult
	var at report.ActionTimes
	for _, n := range rounds(p.N, e.Opts.MaxLive) {
		ids, err := e.fill(ctx, "destroy: setup", n, 4)
		if err != nil {
			return nil, err
		}
		e.Progress.Start("destroy", n)
		// Not cancellable: a half-run destroy phase must still remove
		// every sandbox it was given.
		d := drive(context.WithoutCancel(ctx), e.Progress, n, p.Concurrency, func(ctx context.Context, i int) (time.Duration, error) {
			start := time.Now()
			resp, err := e.Client.DeleteSandbox(ctx, &pb.DeleteSandboxRequest{SandboxId: ids[i]})
			if err != nil {
				return 0, err
			}
			d := time.Since(start)
			addTimings(&at, resp.Timings)
			return d, nil
		})
		e.Progress.Finish()
		all.merge(d)
		if err := ctx.Err(); err != nil {
			return nil, err
		}
	}
	r, err := all.result("destroy", report.KindCube, p)
	if err != nil {
		return nil, err
	}
	r.Acts = &at
	return r, nil
}
