package workflow

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"sync"
	"time"

	"github.com/cubesandbox/cube/internal/failpoint"
)

// run is one execution of a flow. timings is only touched by the goroutine
// that drives the run; step goroutines write to their own slots.
type run[T any] struct {
	e       *Engine[T]
	f       *flow[T]
	t       T
	timings []Timing
}

// forward runs Forward and Init flows: steps in order until one fails, then
// (Forward with an Undo) undoes every started action in reverse.
func (r *run[T]) forward(ctx context.Context) error {
	var failed error
	last := -1 // last step started
	for i := range r.f.steps {
		if err := ctx.Err(); err != nil {
			failed = fmt.Errorf("workflow: flow %q step %d: not started: %w", r.f.name, i+1, err)
			break
		}
		last = i
		if err := r.step(ctx, i); err != nil {
			failed = err
			break
		}
	}
	if failed == nil || r.f.verb.Mode != Forward || r.f.verb.Undo == nil {
		return failed
	}
	// The undo's own context: not ended by the caller's cancel (the
	// rollback must finish), bounded by the engine's undo bound.
	uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.e.undoBound)
	defer cancel()
	if uerr := r.undo(uctx, last); uerr != nil {
		return fmt.Errorf("%w; %w: %w", failed, ErrUndoIncomplete, uerr)
	}
	return failed
}

// teardown runs every step whatever fails and joins the errors.
func (r *run[T]) teardown(ctx context.Context) error {
	var errs []error
	for i := range r.f.steps {
		errs = append(errs, r.step(ctx, i))
	}
	return errors.Join(errs...)
}

// step runs the actions of step i in parallel, waits for all of them, and
// returns their errors joined in declaration order.
func (r *run[T]) step(ctx context.Context, i int) error {
	actions := r.f.steps[i]
	timings := make([]Timing, len(actions))
	errs := make([]error, len(actions))
	if len(actions) == 1 {
		timings[0], errs[0] = r.do(ctx, i, actions[0])
	} else {
		var wg sync.WaitGroup
		for j, a := range actions {
			wg.Go(func() { timings[j], errs[j] = r.do(ctx, i, a) })
		}
		wg.Wait()
	}
	r.timings = append(r.timings, timings...)
	return errors.Join(errs...)
}

// do calls the verb on a, between the "<flow>/<action>" and
// "<flow>/<action>/after" failpoints.
func (r *run[T]) do(ctx context.Context, i int, a Action) (Timing, error) {
	fp := r.f.name + "/" + a.Name()
	return r.call(ctx, i, a, PhaseDo, func() error {
		if err := r.failpoint(ctx, fp); err != nil {
			return err
		}
		if err := r.f.verb.Call(ctx, a, r.t); err != nil {
			return err
		}
		return r.failpoint(ctx, fp+"/after")
	})
}

// undo undoes, one at a time, every action of steps last..0 in reverse
// declaration order, and joins the errors.
func (r *run[T]) undo(ctx context.Context, last int) error {
	var errs []error
	for i := last; i >= 0; i-- {
		for j := len(r.f.steps[i]) - 1; j >= 0; j-- {
			a := r.f.steps[i][j]
			tm, err := r.call(ctx, i, a, PhaseUndo, func() error {
				if err := r.failpoint(ctx, r.f.name+"/"+a.Name()+"/undo"); err != nil {
					return err
				}
				return r.f.verb.Undo(ctx, a, r.t)
			})
			r.timings = append(r.timings, tm)
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// call runs fn for a, recovering a panic into an error, and times, logs and
// observes it. The returned error names flow, step and action.
func (r *run[T]) call(ctx context.Context, i int, a Action, phase string, fn func() error) (tm Timing, err error) {
	name := a.Name()
	start := time.Now()
	func() {
		defer func() {
			if p := recover(); p != nil {
				err = fmt.Errorf("panic: %v", p)
				r.e.log.LogAttrs(ctx, slog.LevelError, "workflow action panicked",
					slog.String("flow", r.f.name), slog.String("action", name), slog.String("phase", phase),
					slog.Any("panic", p), slog.String("stack", string(debug.Stack())))
			}
		}()
		err = fn()
	}()
	d := time.Since(start)
	r.e.m.observeAction(r.f.name, name, phase, d, err)
	tm = Timing{Step: i + 1, Action: name, Phase: phase, Duration: d}
	if err == nil {
		r.e.log.LogAttrs(ctx, slog.LevelDebug, "workflow action done", slog.String("flow", r.f.name),
			slog.Int("step", i+1), slog.String("action", name), slog.String("phase", phase), slog.Duration("duration", d))
		return tm, nil
	}
	tm.Err = err.Error()
	level := slog.LevelWarn
	if phase == PhaseUndo {
		level = slog.LevelError
	}
	r.e.log.LogAttrs(ctx, level, "workflow action failed", slog.String("flow", r.f.name),
		slog.Int("step", i+1), slog.String("action", name), slog.String("phase", phase),
		slog.Duration("duration", d), slog.Any("error", err))
	if phase == PhaseUndo {
		return tm, fmt.Errorf("workflow: flow %q step %d action %q: undo: %w", r.f.name, i+1, name, err)
	}
	return tm, fmt.Errorf("workflow: flow %q step %d action %q: %w", r.f.name, i+1, name, err)
}

func (r *run[T]) failpoint(ctx context.Context, name string) error {
	if !r.e.failpoints {
		return nil
	}
	return failpoint.Eval(ctx, name)
}
