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

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/bench/raw"
	"github.com/cubesandbox/cube/internal/bench/report"
)

// The raw baselines. Each times the building block a cube scenario stands
// on, in the same run, on the same rootfs, with the same readiness check.
func init() {
	Register(Scenario{
		Name: "runc-run", Kind: report.KindBaseline, Runtime: "runc",
		Help:   "bare `runc run -d` of cube-agent on a fresh loop-mounted ext4 clone + first /health answer",
		Params: func(o report.Options) report.Params { return report.Params{N: o.N1, Concurrency: 1} },
		Probe:  probeRaw,
		Run:    runRuncRun,
	})
	Register(Scenario{
		Name: "runc-pause", Kind: report.KindBaseline, Runtime: "runc",
		Help:   "bare `runc pause` of a running container",
		Params: func(o report.Options) report.Params { return report.Params{N: o.N1, Concurrency: 1} },
		Probe:  probeRaw,
		Run: func(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
			return rawCycle(ctx, e, p, "runc-pause")
		},
	})
	Register(Scenario{
		Name: "runc-resume", Kind: report.KindBaseline, Runtime: "runc",
		Help:   "bare `runc resume` of a paused container",
		Params: func(o report.Options) report.Params { return report.Params{N: o.N1, Concurrency: 1} },
		Probe:  probeRaw,
		Run: func(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
			return rawCycle(ctx, e, p, "runc-resume")
		},
	})
	Register(Scenario{
		Name: "freezer-freeze", Kind: report.KindBaseline, Runtime: "runc",
		Help:   "raw cgroup freezer write (FROZEN / cgroup.freeze=1) until the kernel reports frozen",
		Params: func(o report.Options) report.Params { return report.Params{N: o.N1, Concurrency: 1} },
		Probe:  probeRaw,
		Run: func(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
			return rawCycle(ctx, e, p, "freezer-freeze")
		},
	})
	Register(Scenario{
		Name: "freezer-thaw", Kind: report.KindBaseline, Runtime: "runc",
		Help:   "raw cgroup freezer write (THAWED / cgroup.freeze=0) until the kernel reports thawed",
		Params: func(o report.Options) report.Params { return report.Params{N: o.N1, Concurrency: 1} },
		Probe:  probeRaw,
		Run: func(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
			return rawCycle(ctx, e, p, "freezer-thaw")
		},
	})
	Register(Scenario{
		Name: "runc-delete", Kind: report.KindBaseline, Runtime: "runc",
		Help:   "bare `runc delete --force` of a running container (kill, wait, remove state and cgroup)",
		Params: func(o report.Options) report.Params { return report.Params{N: o.N1, Concurrency: 1} },
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

// raw sets the raw runc node up once per Env.
func (e *Env) raw(ctx context.Context) (*raw.Runc, error) {
	e.rawOnce.Do(func() { e.rawNode, e.rawErr = e.newRawNode(ctx) })
	return e.rawNode, e.rawErr
}

func (e *Env) newRawNode(ctx context.Context) (*raw.Runc, error) {
	if err := probeRaw(ctx, e); err != nil {
		return nil, err
	}
	dir, err := e.scratch("raw")
	if err != nil {
		return nil, err
	}
	return raw.NewRunc(ctx, dir, "cube-bench-raw-"+e.RunID, e.Opts.ImageLayout, e.Opts.AgentBinary)
}

// prepareBoxes prepares n boxes, c at a time (untimed).
func prepareBoxes(ctx context.Context, e *Env, n, c int, start bool) ([]*raw.Box, error) {
	r, err := e.raw(ctx)
	if err != nil {
		return nil, err
	}
	var (
		mu    sync.Mutex
		boxes []*raw.Box
	)
	label := "raw: setup"
	e.Progress.Start(label, n)
	d := drive(ctx, e.Progress, n, c, func(ctx context.Context, _ int) (time.Duration, error) {
		b, err := r.Prepare(ctx)
		if err != nil {
			return 0, err
		}
		mu.Lock()
		boxes = append(boxes, b)
		mu.Unlock()
		if start {
			pid, err := b.Start(ctx)
			if err != nil {
				return 0, err
			}
			return 0, raw.WaitAgent(ctx, pid)
		}
		return 0, nil
	})
	e.Progress.Finish()
	if d.failed > 0 || ctx.Err() != nil {
		return nil, errors.Join(fmt.Errorf("prepare raw containers: %w", errors.Join(d.errs...)), ctx.Err(), destroyBoxes(ctx, e, boxes, c))
	}
	return boxes, nil
}

func destroyBoxes(ctx context.Context, e *Env, boxes []*raw.Box, c int) error {
	if len(boxes) == 0 {
		return nil
	}
	e.Progress.Start("raw: cleanup", len(boxes))
	defer e.Progress.Finish()
	d := drive(context.WithoutCancel(ctx), e.Progress, len(boxes), c, func(ctx context.Context, i int) (time.Duration, error) {
		return 0, boxes[i].Destroy(ctx)
	})
	return errors.Join(d.errs...)
}

// runRuncRun times `runc run -d` + first /health in rounds shaped like
// create's: prepare a round's rootfs clones, start them all (timed,
// Concurrency at a time), then tear the round down.
func runRuncRun(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
	var all driveResult
	for _, n := range rounds(p.N, e.Opts.MaxLive) {
		boxes, err := prepareBoxes(ctx, e, n, p.Concurrency, false)
		if err != nil {
			return nil, err
		}
		e.Progress.Start("runc-run", n)
		d := drive(ctx, e.Progress, n, p.Concurrency, func(ctx context.Context, i int) (time.Duration, error) {
			start := time.Now()
			pid, err := boxes[i].Start(ctx)
			if err != nil {
				return 0, err
			}
			if err := raw.WaitAgent(ctx, pid); err != nil {
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
	return all.result("runc-run", report.KindBaseline, p)
}

// rawCycle pauses and resumes one bare container N times, with runc and
// with the freezer directly; each of the four baselines reuses the cycles
// measured for the first one asked for.
func rawCycle(ctx context.Context, e *Env, p report.Params, want string) (*report.Result, error) {
	if b, ok := e.recall(want, p); ok {
		return b.result(want, report.KindBaseline, p), nil
	}
	boxes, err := prepareBoxes(ctx, e, 1, 1, true)
	if err != nil {
		return nil, err
	}
	b := boxes[0]
	runErr := func() error {
		fz, err := raw.FreezerOf(b.PID)
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
				{&rp, func() error { return b.Runc(ctx, "pause", b.ID) }},
				{&rr, func() error { return b.Runc(ctx, "resume", b.ID) }},
				{&ff, fz.Freeze},
				{&ft, fz.Thaw},
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
	return got.result(want, report.KindBaseline, p), nil
}

// runRuncDelete times `runc delete --force` of running containers; the
// rootfs unmount and clone removal that follow are untimed.
func runRuncDelete(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
	var all driveResult
	for _, n := range rounds(p.N, e.Opts.MaxLive) {
		boxes, err := prepareBoxes(ctx, e, n, 4, true)
		if err != nil {
			return nil, err
		}
		e.Progress.Start("runc-delete", n)
		d := drive(context.WithoutCancel(ctx), e.Progress, n, p.Concurrency, func(ctx context.Context, i int) (time.Duration, error) {
			start := time.Now()
			if err := boxes[i].Runc(ctx, "delete", "--force", boxes[i].ID); err != nil {
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
	return all.result("runc-delete", report.KindBaseline, p)
}

// runReflinkCopy times FICLONE of the raw template image into a new file
// (what a runc snapshot does to a sandbox's disk).
func runReflinkCopy(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
	r, err := e.raw(ctx)
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(r.PoolDir(), "reflink-copy")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	e.Progress.Start("reflink-copy", p.N)
	d := drive(ctx, e.Progress, p.N, p.Concurrency, func(ctx context.Context, i int) (time.Duration, error) {
		dst := filepath.Join(dir, fmt.Sprintf("%d.img", i))
		defer os.Remove(dst)
		src, err := os.Open(r.Image())
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
	return d.result("reflink-copy", report.KindBaseline, p)
}

// runRunscRestore times raw.RunscRestore. Setup (untimed) creates a
// sandbox from the warmed template through cubelet, so it has what a
// sandbox has (disk, network slot, bundle), and pauses it to disk so that
// cubelet's runtime watch lets go of its runsc process; cleanup deletes
// it through cubelet.
func runRunscRestore(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
	mem, _, err := e.warmSnapshotFiles(ctx)
	if err != nil {
		return nil, err
	}
	w, err := e.warm(ctx)
	if err != nil {
		return nil, err
	}
	root := filepath.Join(e.node.RunDir, "runsc")
	e.Progress.Start("runsc-restore", p.N)
	d := drive(ctx, e.Progress, p.N, 1, func(ctx context.Context, _ int) (time.Duration, error) {
		resp, err := e.Client.CreateSandbox(ctx, &pb.CreateSandboxRequest{
			TemplateId: w.id, Runtime: "gvisor", Labels: map[string]string{LabelKey: e.RunID},
		})
		if err != nil {
			return 0, fmt.Errorf("setup create: %w", err)
		}
		id := resp.Sandbox.Id
		// Paused to disk, the sandbox has no runsc process left and
		// cubelet no longer watches one: the bare restore that takes its
		// place is not taken for the sandbox dying.
		release := func(ctx context.Context) error {
			_, err := e.Client.PauseSandbox(ctx, &pb.PauseSandboxRequest{SandboxId: id, Mode: pb.PauseMode_PAUSE_MODE_DISK})
			return err
		}
		took, err := raw.RunscRestore(ctx, root, mem, id, resp.Sandbox.GetNetwork().GetHostIp(), release)
		return took, errors.Join(err, e.deleteAll(ctx, "", []string{resp.Sandbox.Id}, 1))
	})
	e.Progress.Finish()
	return d.result("runsc-restore", report.KindBaseline, p)
}

// runRunscCheckpointRestore times raw.RunscCheckpointRestore, with the
// setup and cleanup of runRunscRestore; each sample checkpoints into a
// directory of its own in the pool.
func runRunscCheckpointRestore(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
	mem, _, err := e.warmSnapshotFiles(ctx)
	if err != nil {
		return nil, err
	}
	w, err := e.warm(ctx)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp(filepath.Join(e.node.DataDir, "pool"), "bench-raw-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	root := filepath.Join(e.node.RunDir, "runsc")
	e.Progress.Start("runsc-checkpoint-restore", p.N)
	d := drive(ctx, e.Progress, p.N, 1, func(ctx context.Context, i int) (time.Duration, error) {
		resp, err := e.Client.CreateSandbox(ctx, &pb.CreateSandboxRequest{
			TemplateId: w.id, Runtime: "gvisor", Labels: map[string]string{LabelKey: e.RunID},
		})
		if err != nil {
			return 0, fmt.Errorf("setup create: %w", err)
		}
		id := resp.Sandbox.Id
		release := func(ctx context.Context) error {
			_, err := e.Client.PauseSandbox(ctx, &pb.PauseSandboxRequest{SandboxId: id, Mode: pb.PauseMode_PAUSE_MODE_DISK})
			return err
		}
		img := filepath.Join(dir, fmt.Sprint(i))
		took, err := raw.RunscCheckpointRestore(ctx, root, mem, img, id, resp.Sandbox.GetNetwork().GetHostIp(), release)
		return took, errors.Join(err, e.deleteAll(ctx, "", []string{id}, 1), os.RemoveAll(img))
	})
	e.Progress.Finish()
	return d.result("runsc-checkpoint-restore", report.KindBaseline, p)
}

// runQemuIncoming times raw.Incoming of the warm template's snapshot.
func runQemuIncoming(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
	mem, disk, err := e.warmSnapshotFiles(ctx)
	if err != nil {
		return nil, err
	}
	// In the pool (FICLONE needs the same filesystem), outside the
	// directories cubelet owns in it.
	dir, err := os.MkdirTemp(filepath.Join(e.node.DataDir, "pool"), "bench-raw-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	e.Progress.Start("qemu-incoming", p.N)
	d := drive(ctx, e.Progress, p.N, 1, func(ctx context.Context, i int) (time.Duration, error) {
		return raw.Incoming(ctx, mem, disk, filepath.Join(dir, fmt.Sprint(i)), uint32(1000+i))
	})
	e.Progress.Finish()
	return d.result("qemu-incoming", report.KindBaseline, p)
}

// runQemuIncomingFull times raw.Incoming of a full memory image of the
// warm template's snapshot (raw.FullImage, made once, untimed): the
// restore that copies the whole guest in, which shared memory replaces.
func runQemuIncomingFull(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
	mem, disk, err := e.warmSnapshotFiles(ctx)
	if err != nil {
		return nil, err
	}
	if !raw.SharedMemory(mem) {
		return nil, skipf("the warm snapshot has no shared memory: qemu-incoming is the full restore already")
	}
	dir, err := os.MkdirTemp(filepath.Join(e.node.DataDir, "pool"), "bench-raw-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	full := filepath.Join(dir, "full")
	if err := raw.FullImage(ctx, mem, disk, filepath.Join(dir, "make"), full); err != nil {
		return nil, fmt.Errorf("full image of the warm snapshot: %w", err)
	}
	e.Progress.Start("qemu-incoming-full", p.N)
	d := drive(ctx, e.Progress, p.N, 1, func(ctx context.Context, i int) (time.Duration, error) {
		return raw.Incoming(ctx, full, disk, filepath.Join(dir, fmt.Sprint(i)), uint32(1000+i))
	})
	e.Progress.Finish()
	return d.result("qemu-incoming-full", report.KindBaseline, p)
}
