package bench

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/bench/report"
)

// The restart scenario: create-to-ready (each sandbox deleted at once)
// on Concurrency workers while the private cubelet is SIGKILLed halfway
// through and started again a second later, as `cube up`'s supervisor
// does. A create waits for the node the way cubemaster does for a node
// that is restarting (gRPC WaitForReady: the call is made once the node
// answers again), and one whose answer the kill cut off is made again
// (cubelet's restart undoes an unfinished create; a finished one is
// removed by the run's sweep), its latency counted from the first
// attempt, as a client of cubemaster sees it; a delete is made again the
// same way. The report's latency is of every create; its notes split it
// into before, across and after the restart and give the restart window:
// how long the node was down (kill to API answering) and how long creates
// waited (kill to the first create that completed after it).

// restartWait bounds one create's wait for the node (cubemaster's
// nodes.restart_wait is 15 s; a bench on a loaded machine gets more).
const restartWait = 2 * time.Minute

func init() {
	Register(Scenario{
		Name: "restart", Kind: report.KindCube,
		Help:   "create-to-ready, 4 in flight, while cubelet is SIGKILLed and restarted: latency before/across/after and the window creates waited",
		Params: func(o report.Options) report.Params { return report.Params{N: max(o.N1, 8), Concurrency: 4} },
		Probe: func(_ context.Context, e *Env) error {
			if e.node == nil {
				return skipf("it restarts a private node's cubelet (not with --addr)")
			}
			return nil
		},
		Run: runRestart,
	})
}

type restartSample struct {
	start, end time.Time
	retried    int
}

func runRestart(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
	nd := e.node
	var (
		mu      sync.Mutex
		samples []restartSample
		errs    []error
		failed  int
	)
	done := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(samples)
	}
	// Workers finish the create in hand once told to stop, so none is
	// cut off at the end (ctx still ends them at once).
	var stopping atomic.Bool
	wctx := ctx
	stop := func() { stopping.Store(true) }
	e.Progress.Start("restart", p.N)
	defer e.Progress.Finish()
	var wg sync.WaitGroup
	begin := time.Now()
	for range p.Concurrency {
		wg.Go(func() {
			for wctx.Err() == nil && !stopping.Load() {
				s, id, err := e.createWaiting(wctx)
				if err == nil {
					err = e.deleteWaiting(context.WithoutCancel(wctx), id)
				}
				mu.Lock()
				if err != nil && wctx.Err() == nil {
					failed++
					if len(errs) < report.KeepErrors {
						errs = append(errs, err)
					}
				} else if err == nil {
					samples = append(samples, s)
				}
				mu.Unlock()
				e.Progress.Step(err == nil)
			}
		})
	}
	wait := func(n int) error {
		for done() < n {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(10 * time.Millisecond):
			}
		}
		return nil
	}
	var killed, up time.Time
	err := wait(p.N / 2)
	if err == nil {
		killed = time.Now()
		err = nd.Kill()
	}
	if err == nil {
		select {
		case <-ctx.Done():
			err = ctx.Err()
		case <-time.After(time.Second): // cube up's supervisor's first backoff
		}
	}
	if err == nil {
		if err = nd.Restart(ctx); err == nil {
			up = time.Now()
			e.CubeletPID = nd.PID()
		}
	}
	if err == nil {
		err = wait(p.N)
	}
	stop()
	wg.Wait()
	if err != nil {
		return nil, fmt.Errorf("restart: %w", err)
	}
	wall := time.Since(begin)
	// What creates whose answer the kill cut off left on the node (a
	// client of cubemaster never sees these: its undo deletes them).
	left := map[string]int{}
	if resp, err := e.Client.ListSandboxes(ctx, &pb.ListSandboxesRequest{Labels: map[string]string{LabelKey: e.RunID}}); err == nil {
		var ids []string
		for _, sb := range resp.Sandboxes {
			left[sb.State.String()]++
			ids = append(ids, sb.Id)
		}
		if err := e.deleteAll(ctx, "", ids, p.Concurrency); err != nil {
			return nil, fmt.Errorf("restart: %w", err)
		}
	}

	var all, before, across, after []time.Duration
	var firstAfter time.Time
	retried := 0
	for _, s := range samples {
		d := s.end.Sub(s.start)
		all = append(all, d)
		retried += s.retried
		switch {
		case s.end.Before(killed):
			before = append(before, d)
		case s.start.After(up):
			after = append(after, d)
		default:
			across = append(across, d)
		}
		if s.end.After(killed) && (firstAfter.IsZero() || s.end.Before(firstAfter)) {
			firstAfter = s.end
		}
	}
	d := driveResult{samples: all, failed: failed, errs: errs, wall: wall}
	r, err := d.result("restart", report.KindCube, p)
	if err != nil {
		return nil, err
	}
	line := func(name string, ds []time.Duration) string {
		s := report.Summarize(ds)
		return fmt.Sprintf("%s: %d creates, p50 %s p99 %s max %s", name, s.N,
			s.P50.Round(time.Millisecond), s.P99.Round(time.Millisecond), s.Max.Round(time.Millisecond))
	}
	r.Notes = append(r.Notes,
		line("before the kill", before), line("across the restart", across), line("after it", after),
		fmt.Sprintf("restart window: cubelet down %s (SIGKILL to its API answering, 1 s of it the supervisor's backoff); creates waited %s (SIGKILL to the first create completed after it)",
			up.Sub(killed).Round(time.Millisecond), firstAfter.Sub(killed).Round(time.Millisecond)),
		fmt.Sprintf("%d create(s) lost their answer to the kill and were made again; the node then held %v of theirs (deleted)", retried, left))
	return r, nil
}

// createWaiting creates a sandbox, waiting for the node while it is down
// and making the create again when the kill cut its answer off.
func (e *Env) createWaiting(ctx context.Context) (restartSample, string, error) {
	s := restartSample{start: time.Now()}
	ctx, cancel := context.WithTimeout(ctx, restartWait)
	defer cancel()
	for {
		resp, err := e.Client.CreateSandbox(ctx, &pb.CreateSandboxRequest{
			TemplateId: e.Opts.Template, Runtime: e.Opts.Runtime,
			Labels: map[string]string{LabelKey: e.RunID},
		}, grpc.WaitForReady(true))
		if err == nil {
			s.end = time.Now()
			return s, resp.Sandbox.Id, nil
		}
		if status.Code(err) != codes.Unavailable || ctx.Err() != nil {
			return s, "", errors.Join(fmt.Errorf("create: %w", err), ctx.Err())
		}
		s.retried++
	}
}

// deleteWaiting deletes a sandbox, waiting for the node while it is down
// and making the delete again when the kill cut its answer off.
func (e *Env) deleteWaiting(ctx context.Context, id string) error {
	ctx, cancel := context.WithTimeout(ctx, restartWait)
	defer cancel()
	for {
		_, err := e.Client.DeleteSandbox(ctx, &pb.DeleteSandboxRequest{SandboxId: id}, grpc.WaitForReady(true))
		switch {
		case err == nil, status.Code(err) == codes.NotFound:
			return nil
		case status.Code(err) != codes.Unavailable || ctx.Err() != nil:
			return errors.Join(fmt.Errorf("delete %s: %w", id, err), ctx.Err())
		}
	}
}
