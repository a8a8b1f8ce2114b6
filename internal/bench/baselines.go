package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// The raw baselines. Each times the building block a cube scenario stands
// on, in the same run, on the same rootfs, with the same readiness check.
func init() {
	Register(Scenario{
		Name: "runc-run", Kind: KindBaseline, Runtime: "runc",
		Help:   "bare `runc run -d` of cube-agent on a fresh loop-mounted ext4 clone + first /health answer",
		Params: func(o Options) Params { return Params{N: o.N1, Concurrency: 1} },
		Probe:  probeRaw,
		Run:    runRuncRun,
	})
	Register(Scenario{
		Name: "runc-pause", Kind: KindBaseline, Runtime: "runc",
		Help:   "bare `runc pause` of a running container",
		Params: func(o Options) Params { return Params{N: o.N1, Concurrency: 1} },
		Probe:  probeRaw,
		Run:    func(ctx context.Context, e *Env, p Params) (*Result, error) { return rawCycle(ctx, e, p, "runc-pause") },
	})
	Register(Scenario{
		Name: "runc-resume", Kind: KindBaseline, Runtime: "runc",
		Help:   "bare `runc resume` of a paused container",
		Params: func(o Options) Params { return Params{N: o.N1, Concurrency: 1} },
		Probe:  probeRaw,
		Run: func(ctx context.Context, e *Env, p Params) (*Result, error) {
			return rawCycle(ctx, e, p, "runc-resume")
		},
	})
	Register(Scenario{
		Name: "freezer-freeze", Kind: KindBaseline, Runtime: "runc",
		Help:   "raw cgroup freezer write (FROZEN / cgroup.freeze=1) until the kernel reports frozen",
		Params: func(o Options) Params { return Params{N: o.N1, Concurrency: 1} },
		Probe:  probeRaw,
		Run: func(ctx context.Context, e *Env, p Params) (*Result, error) {
			return rawCycle(ctx, e, p, "freezer-freeze")
		},
	})
	Register(Scenario{
		Name: "freezer-thaw", Kind: KindBaseline, Runtime: "runc",
		Help:   "raw cgroup freezer write (THAWED / cgroup.freeze=0) until the kernel reports thawed",
		Params: func(o Options) Params { return Params{N: o.N1, Concurrency: 1} },
		Probe:  probeRaw,
		Run: func(ctx context.Context, e *Env, p Params) (*Result, error) {
			return rawCycle(ctx, e, p, "freezer-thaw")
		},
	})
	Register(Scenario{
		Name: "runc-delete", Kind: KindBaseline, Runtime: "runc",
		Help:   "bare `runc delete --force` of a running container (kill, wait, remove state and cgroup)",
		Params: func(o Options) Params { return Params{N: o.N1, Concurrency: 1} },
		Probe:  probeRaw,
		Run:    runRuncDelete,
	})
}

func probeRaw(ctx context.Context, e *Env) error {
	if _, err := exec.LookPath("runc"); err != nil {
		return skipf("runc is not installed")
	}
	if e.Opts.ImageLayout == "" || e.Opts.AgentBinary == "" {
		return skipf("raw baselines need the busybox image layout and the cube-agent binary")
	}
	return nil
}

// prepareBoxes prepares n boxes, c at a time (untimed).
func prepareBoxes(ctx context.Context, e *Env, n, c int, start bool) ([]*rawBox, error) {
	r, err := e.raw(ctx)
	if err != nil {
		return nil, err
	}
	var (
		mu    sync.Mutex
		boxes []*rawBox
	)
	label := "raw: setup"
	e.Progress.Start(label, n)
	d := drive(ctx, e.Progress, n, c, func(ctx context.Context, _ int) (time.Duration, error) {
		b, err := r.prepare(ctx)
		if err != nil {
			return 0, err
		}
		mu.Lock()
		boxes = append(boxes, b)
		mu.Unlock()
		if start {
			pid, err := b.start(ctx)
			if err != nil {
				return 0, err
			}
			return 0, waitAgent(ctx, pid)
		}
		return 0, nil
	})
	e.Progress.Finish()
	if d.failed > 0 || ctx.Err() != nil {
		return nil, errors.Join(fmt.Errorf("prepare raw containers: %w", errors.Join(d.errs...)), ctx.Err(), destroyBoxes(ctx, e, boxes, c))
	}
	return boxes, nil
}

func destroyBoxes(ctx context.Context, e *Env, boxes []*rawBox, c int) error {
	if len(boxes) == 0 {
		return nil
	}
	e.Progress.Start("raw: cleanup", len(boxes))
	defer e.Progress.Finish()
	d := drive(context.WithoutCancel(ctx), e.Progress, len(boxes), c, func(ctx context.Context, i int) (time.Duration, error) {
		return 0, boxes[i].destroy(ctx)
	})
	return errors.Join(d.errs...)
}

// runRuncRun times `runc run -d` + first /health in rounds shaped like
// create's: prepare a round's rootfs clones, start them all (timed,
// Concurrency at a time), then tear the round down.
func runRuncRun(ctx context.Context, e *Env, p Params) (*Result, error) {
	var all driveResult
	for _, n := range rounds(p.N, e.Opts.MaxLive) {
		boxes, err := prepareBoxes(ctx, e, n, p.Concurrency, false)
		if err != nil {
			return nil, err
		}
		e.Progress.Start("runc-run", n)
		d := drive(ctx, e.Progress, n, p.Concurrency, func(ctx context.Context, i int) (time.Duration, error) {
			start := time.Now()
			pid, err := boxes[i].start(ctx)
			if err != nil {
				return 0, err
			}
			if err := waitAgent(ctx, pid); err != nil {
				return 0, err
			}
			return time.Since(start), nil
		})
		e.Progress.Finish()
		all.merge(d)
		if err := destroyBoxes(ctx, e, boxes, p.Concurrency); err != nil {
			return nil, err
		}
		if err := ctx.Err(); err != nil {
			return nil, err
		}
	}
	return all.result("runc-run", KindBaseline, p)
}

// rawCycle pauses and resumes one bare container N times, with runc and
// with the freezer directly; each of the four baselines reuses the cycles
// measured for the first one asked for.
func rawCycle(ctx context.Context, e *Env, p Params, want string) (*Result, error) {
	if b, ok := e.recall(want, p); ok {
		return b.result(want, KindBaseline, p), nil
	}
	boxes, err := prepareBoxes(ctx, e, 1, 1, true)
	if err != nil {
		return nil, err
	}
	b := boxes[0]
	runErr := func() error {
		fz, err := freezerOf(b.pid)
		if err != nil {
			return err
		}
		var rp, rr, ff, ft []time.Duration
		e.Progress.Start("raw pause/resume", p.N)
		defer e.Progress.Finish()
		timeIt := func(dst *[]time.Duration, f func() error) error {
			start := time.Now()
			if err := f(); err != nil {
				return err
			}
			*dst = append(*dst, time.Since(start))
			return nil
		}
		for range p.N {
			if err := ctx.Err(); err != nil {
				return err
			}
			steps := []struct {
				dst *[]time.Duration
				f   func() error
			}{
				{&rp, func() error { return b.runcCmd(ctx, "pause", b.id) }},
				{&rr, func() error { return b.runcCmd(ctx, "resume", b.id) }},
				{&ff, fz.freeze},
				{&ft, fz.thaw},
			}
			for _, s := range steps {
				if err := timeIt(s.dst, s.f); err != nil {
					return err
				}
			}
			e.Progress.Step(true)
		}
		e.remember("runc-pause", p, batch{samples: rp})
		e.remember("runc-resume", p, batch{samples: rr})
		e.remember("freezer-freeze", p, batch{samples: ff})
		e.remember("freezer-thaw", p, batch{samples: ft})
		return nil
	}()
	if err := errors.Join(runErr, destroyBoxes(ctx, e, boxes, 1)); err != nil {
		return nil, err
	}
	got, _ := e.recall(want, p)
	return got.result(want, KindBaseline, p), nil
}

// runRuncDelete times `runc delete --force` of running containers; the
// rootfs unmount and clone removal that follow are untimed.
func runRuncDelete(ctx context.Context, e *Env, p Params) (*Result, error) {
	var all driveResult
	for _, n := range rounds(p.N, e.Opts.MaxLive) {
		boxes, err := prepareBoxes(ctx, e, n, 4, true)
		if err != nil {
			return nil, err
		}
		e.Progress.Start("runc-delete", n)
		d := drive(context.WithoutCancel(ctx), e.Progress, n, p.Concurrency, func(ctx context.Context, i int) (time.Duration, error) {
			start := time.Now()
			if err := boxes[i].runcCmd(ctx, "delete", "--force", boxes[i].id); err != nil {
				return 0, err
			}
			return time.Since(start), nil
		})
		e.Progress.Finish()
		all.merge(d)
		if err := destroyBoxes(ctx, e, boxes, 4); err != nil {
			return nil, err
		}
		if err := ctx.Err(); err != nil {
			return nil, err
		}
	}
	return all.result("runc-delete", KindBaseline, p)
}

// runReflinkCopy times FICLONE of the raw template image into a new file
// (what a runc snapshot does to a sandbox's disk).
func runReflinkCopy(ctx context.Context, e *Env, p Params) (*Result, error) {
	r, err := e.raw(ctx)
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(r.pool.Dir(), "reflink-copy")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	e.Progress.Start("reflink-copy", p.N)
	d := drive(ctx, e.Progress, p.N, p.Concurrency, func(ctx context.Context, i int) (time.Duration, error) {
		dst := filepath.Join(dir, fmt.Sprintf("%d.img", i))
		defer os.Remove(dst)
		src, err := os.Open(r.image)
		if err != nil {
			return 0, err
		}
		defer src.Close()
		start := time.Now()
		out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return 0, err
		}
		err = unix.IoctlFileClone(int(out.Fd()), int(src.Fd()))
		if cerr := out.Close(); err == nil {
			err = cerr
		}
		return time.Since(start), err
	})
	e.Progress.Finish()
	return d.result("reflink-copy", KindBaseline, p)
}
