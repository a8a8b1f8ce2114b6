package bench

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cubesandbox/cube/internal/bench/report"
)

// op is one measured operation. It returns the duration to record: only
// the part being measured (setup and cleanup it does around that are not
// timed). i is the operation's index, 0..n-1.
type op func(ctx context.Context, i int) (time.Duration, error)

// driveResult is what drive measured.
type driveResult struct {
	samples []time.Duration
	errs    []error // first few failures, for the report
	failed  int
	wall    time.Duration
}

// drive runs fn n times on c workers and collects the samples. Failures
// are counted and the first few kept; it stops early only when ctx ends.
// It steps prog once per operation but does not start or finish it.
func drive(ctx context.Context, prog *Progress, n, c int, fn op) driveResult {
	if c < 1 {
		c = 1
	}
	if c > n {
		c = n
	}
	var (
		mu   sync.Mutex
		res  driveResult
		next atomic.Int64
		wg   sync.WaitGroup
	)
	res.samples = make([]time.Duration, 0, n)
	start := time.Now()
	for range c {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				i := int(next.Add(1)) - 1
				if i >= n {
					return
				}
				d, err := fn(ctx, i)
				mu.Lock()
				if err != nil {
					res.failed++
					if len(res.errs) < report.KeepErrors {
						res.errs = append(res.errs, err)
					}
				} else {
					res.samples = append(res.samples, d)
				}
				mu.Unlock()
				prog.Step(err == nil)
			}
		}()
	}
	wg.Wait()
	res.wall = time.Since(start)
	return res
}

// result turns what drive measured into a Result. Failed operations are
// counted and their first errors noted; a scenario in which every one
// failed is reported as failed by Result.finish, once its chunks are
// merged (one chunk failing entirely is not the whole scenario failing).
func (d driveResult) result(name string, kind report.Kind, p report.Params) (*report.Result, error) {
	r := report.Timed(name, kind, p, d.samples, d.failed, d.wall)
	for _, err := range d.errs {
		r.Notes = append(r.Notes, "failure: "+err.Error())
	}
	return r, nil
}

// merge adds another round's measurements.
func (d *driveResult) merge(o driveResult) {
	d.samples = append(d.samples, o.samples...)
	d.failed += o.failed
	d.wall += o.wall
	for _, err := range o.errs {
		if len(d.errs) < report.KeepErrors {
			d.errs = append(d.errs, err)
		}
	}
}

// rounds splits n into consecutive rounds of at most size (size <= 0 = one
// round).
func rounds(n, size int) []int {
	if size <= 0 || size >= n {
		return []int{n}
	}
	var out []int
	for n > 0 {
		r := min(size, n)
		out = append(out, r)
		n -= r
	}
	return out
}
