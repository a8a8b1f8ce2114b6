package bench

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"time"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/bench/raw"
	"github.com/cubesandbox/cube/internal/bench/report"
)

// Warm templates and pause to disk: what only runtimes with memory
// snapshots (gvisor, vm) can do. A separate template is warmed, so the
// cold create scenarios of the same run keep booting.

// memoryRuntime skips unless the runtime the run uses can checkpoint and
// restore memory.
func memoryRuntime(ctx context.Context, e *Env) error {
	info, err := e.Info(ctx)
	if err != nil {
		return err
	}
	rt := e.Opts.Runtime
	if rt == "" {
		rt = "runc"
	}
	for _, r := range info.Runtimes {
		if r.Name == rt {
			if !r.Checkpoint || !r.Restore {
				return skipf("runtime %s cannot take memory snapshots (run with --runtime gvisor or vm)", rt)
			}
			return nil
		}
	}
	return skipf("cubelet does not offer runtime %q", rt)
}

// warmTemplate is the run's warmed copy of the template, made once.
type warmTemplate struct {
	once     sync.Once
	id       string // template ID
	snapshot string // its warm snapshot
	took     time.Duration
	err      error
}

// warm imports the template's image again as <template>-warm-<run> and
// warms it on the run's runtime, once per run; Env.Close deletes it.
func (e *Env) warm(ctx context.Context) (*warmTemplate, error) {
	w := &e.warmT
	w.once.Do(func() {
		if e.Opts.ImageLayout == "" {
			w.err = errors.New("a warmed template needs the test image (a private node or a local cubelet)")
			return
		}
		id := fmt.Sprintf("%s-warm-%s", e.Opts.Template, e.RunID)
		e.Progress.Note("importing and warming template %s on %s", id, e.Opts.Runtime)
		if err := importTemplate(ctx, e.Client, id, e.Opts.ImageLayout); err != nil {
			w.err = err
			return
		}
		w.id = id
		start := time.Now()
		resp, err := e.Client.WarmTemplate(ctx, &pb.WarmTemplateRequest{TemplateId: id, Runtime: e.Opts.Runtime})
		if err != nil {
			w.err = fmt.Errorf("warm template %s: %w", id, err)
			return
		}
		w.took = time.Since(start)
		w.snapshot = resp.Template.WarmSnapshotId
	})
	return w, w.err
}

// close deletes the warmed template (and with it its warm snapshot).
func (w *warmTemplate) close(ctx context.Context, c pb.CubeletServiceClient) error {
	if w.id == "" {
		return nil
	}
	_, err := c.DeleteTemplate(context.WithoutCancel(ctx), &pb.DeleteTemplateRequest{TemplateId: w.id})
	if err != nil {
		return fmt.Errorf("delete warm template %s: %w", w.id, err)
	}
	return nil
}

// warmSnapshotFiles are the warm snapshot's memory dir and disk on a
// private node (raw baselines restore them by hand).
func (e *Env) warmSnapshotFiles(ctx context.Context) (memDir, disk string, err error) {
	if e.node == nil {
		return "", "", skipf("raw restores need the snapshot files of a private node (no --addr)")
	}
	w, err := e.warm(ctx)
	if err != nil {
		return "", "", err
	}
	dir := filepath.Join(e.node.DataDir, "pool", "snapshots", w.snapshot)
	return filepath.Join(dir, "memory"), filepath.Join(dir, "disk.img"), nil
}

func init() {
	Register(Scenario{
		Name: "create-warm", Kind: report.KindCube,
		Help:      "create-to-ready from a warmed template (WarmTemplate once, untimed): a restore of its memory snapshot",
		Baselines: []string{"runsc-restore", "qemu-incoming", "qemu-incoming-full"},
		Params:    func(o report.Options) report.Params { return report.Params{N: o.N1, Concurrency: 1} },
		Probe:     memoryRuntime,
		Run:       runCreateWarm,
	})
	Register(Scenario{
		Name: "pause-disk", Kind: report.KindCube,
		Help:   "PauseSandbox mode DISK: memory image written, runtime stopped",
		Params: func(o report.Options) report.Params { return report.Params{N: o.SnapshotN, Concurrency: 1} },
		Probe:  memoryRuntime,
		Run: func(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
			return pauseResumeDisk(ctx, e, p, "pause-disk")
		},
	})
	Register(Scenario{
		Name: "resume-disk", Kind: report.KindCube,
		Help:   "ResumeSandbox of a sandbox paused to disk: restore until the agent answers",
		Params: func(o report.Options) report.Params { return report.Params{N: o.SnapshotN, Concurrency: 1} },
		Probe:  memoryRuntime,
		Run: func(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
			return pauseResumeDisk(ctx, e, p, "resume-disk")
		},
	})
}

// runCreateWarm times creates from the warmed template, one at a time,
// deleting each before the next (untimed). A create that was not served
// warm fails the sample: it would be a cold boot under the wrong name.
func runCreateWarm(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
	w, err := e.warm(ctx)
	if err != nil {
		return nil, err
	}
	var at report.ActionTimes
	e.Progress.Start("create-warm", p.N)
	d := drive(ctx, e.Progress, p.N, 1, func(ctx context.Context, _ int) (time.Duration, error) {
		start := time.Now()
		resp, err := e.Client.CreateSandbox(ctx, &pb.CreateSandboxRequest{
			TemplateId: w.id, Runtime: e.Opts.Runtime, Labels: map[string]string{LabelKey: e.RunID},
		})
		dur := time.Since(start)
		if err != nil {
			return 0, fmt.Errorf("create: %w", err)
		}
		derr := e.deleteAll(ctx, "", []string{resp.Sandbox.Id}, 1)
		if !resp.Warm {
			return 0, errors.Join(fmt.Errorf("create of %s was not served from the warm snapshot", resp.Sandbox.Id), derr)
		}
		addTimings(&at, resp.Timings)
		return dur, derr
	})
	e.Progress.Finish()
	r, err := d.result("create-warm", report.KindCube, p)
	if r != nil {
		r.Acts = &at
		r.Notes = append(r.Notes, fmt.Sprintf("WarmTemplate (boot + memory snapshot, untimed) took %s", w.took.Round(time.Millisecond)))
		if e.Opts.Runtime == "vm" && err == nil {
			note, merr := e.vmCloneMemory(ctx, w)
			if merr != nil {
				note = "idle VM clone memory: not measured: " + merr.Error()
			}
			r.Notes = append(r.Notes, note)
		}
	}
	return r, err
}

// vmCloneMemN clones are measured together: the template's pages are
// shared between them.
const vmCloneMemN = 5

// vmCloneMemory creates vmCloneMemN clones of the warm template (untimed),
// lets them idle and reads each QEMU's smaps: host memory per idle clone
// as Pss, split into its share of the template's pages and what it owns.
func (e *Env) vmCloneMemory(ctx context.Context, w *warmTemplate) (string, error) {
	var ids []string
	defer func() { _ = e.deleteAll(ctx, "", ids, vmCloneMemN) }()
	for range vmCloneMemN {
		resp, err := e.Client.CreateSandbox(ctx, &pb.CreateSandboxRequest{
			TemplateId: w.id, Runtime: e.Opts.Runtime, Labels: map[string]string{LabelKey: e.RunID},
		})
		if err != nil {
			return "", fmt.Errorf("create: %w", err)
		}
		ids = append(ids, resp.Sandbox.Id)
	}
	select {
	case <-ctx.Done():
		return "", ctx.Err()
	case <-time.After(3 * time.Second):
	}
	var pss, tmpl, own, cow []report.Bytes
	for _, id := range ids {
		sb, err := e.Client.GetSandbox(ctx, &pb.GetSandboxRequest{SandboxId: id})
		if err != nil {
			return "", err
		}
		m, err := raw.VMCloneMem(int(sb.Sandbox.Pid))
		if err != nil {
			return "", fmt.Errorf("sandbox %s: %w", id, err)
		}
		pss, tmpl = append(pss, report.Bytes(m.Pss)), append(tmpl, report.Bytes(m.Template))
		own, cow = append(own, report.Bytes(m.Own)), append(cow, report.Bytes(m.CoW))
	}
	med := func(b []report.Bytes) string { return report.Summarize(b).P50.MiB() }
	return fmt.Sprintf("idle VM clone memory (%d clones of the warm template, p50 of Pss from smaps): %s = %s of the template's shared pages + %s beyond them (%s guest pages copied on write, the rest QEMU itself)",
		vmCloneMemN, med(pss), med(tmpl), med(own), med(cow)), nil
}

// pauseResumeDisk is pauseResume with the memory written to disk.
func pauseResumeDisk(ctx context.Context, e *Env, p report.Params, want string) (*report.Result, error) {
	return pauseCycles(ctx, e, p, want, pauseCycle{pause: "pause-disk", resume: "resume-disk", mode: pb.PauseMode_PAUSE_MODE_DISK})
}
