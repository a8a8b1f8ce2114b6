package bench

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/bench/report"
)

// Snapshots and clones. They probe the RPCs and skip with the
// reason on a cubelet that does not implement them.

func probeSnapshot(ctx context.Context, e *Env) error {
	return implemented(ctx, "SnapshotSandbox", func(ctx context.Context) error {
		_, err := e.Client.SnapshotSandbox(ctx, &pb.SnapshotSandboxRequest{})
		return err
	})
}

func probeClone(ctx context.Context, e *Env) error {
	if err := probeSnapshot(ctx, e); err != nil {
		return err
	}
	return implemented(ctx, "CloneSandbox", func(ctx context.Context) error {
		_, err := e.Client.CloneSandbox(ctx, &pb.CloneSandboxRequest{})
		return err
	})
}

func init() {
	Register(Scenario{
		Name: "snapshot", Kind: report.KindCube,
		Help:      "SnapshotSandbox of a running sandbox (disk; memory where the runtime can checkpoint)",
		Baselines: []string{"reflink-copy", "runsc-checkpoint-restore"},
		Params:    func(o report.Options) report.Params { return report.Params{N: o.SnapshotN, Concurrency: 1} },
		Probe:     probeSnapshot,
		Run:       runSnapshot,
	})
	Register(Scenario{
		Name: "clone-1", Kind: report.KindCube,
		Help:      "CloneSandbox of one sandbox from a snapshot, until its agent answers",
		Baselines: []string{"runc-run", "runsc-restore", "qemu-incoming"},
		Params:    func(o report.Options) report.Params { return report.Params{N: o.SnapshotN, Concurrency: 1} },
		Probe:     probeClone,
		Run: func(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
			return runClone(ctx, e, p, "clone-1", 1)
		},
	})
	Register(Scenario{
		Name: "clone-n", Kind: report.KindCube,
		Help:   "CloneSandbox of --clone-count sandboxes in one call (latency per call)",
		Params: func(o report.Options) report.Params { return report.Params{N: max(1, o.SnapshotN/5), Concurrency: 1} },
		Probe:  probeClone,
		Run: func(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
			return runClone(ctx, e, p, "clone-n", e.Opts.CloneCount)
		},
	})
	Register(Scenario{
		Name: "reflink-copy", Kind: report.KindBaseline,
		Help:   "raw FICLONE of a template-sized disk image (a runc snapshot is a disk clone)",
		Params: func(o report.Options) report.Params { return report.Params{N: o.SnapshotN, Concurrency: 1} },
		Probe:  probeRaw,
		Run:    runReflinkCopy,
	})
}

// runSnapshot times SnapshotSandbox of one running sandbox N times, then
// removes the snapshots and the sandbox.
func runSnapshot(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
	ids, err := e.fill(ctx, "snapshot: setup", 1, 1)
	if err != nil {
		return nil, err
	}
	var snaps []string
	var sizes []int64
	var memory bool
	var at report.ActionTimes
	e.Progress.Start("snapshot", p.N)
	d := drive(ctx, e.Progress, p.N, 1, func(ctx context.Context, _ int) (time.Duration, error) {
		start := time.Now()
		resp, err := e.Client.SnapshotSandbox(ctx, &pb.SnapshotSandboxRequest{SandboxId: ids[0], Labels: map[string]string{LabelKey: e.RunID}})
		if err != nil {
			return 0, err
		}
		d := time.Since(start)
		snaps = append(snaps, resp.Snapshot.Id)
		sizes = append(sizes, resp.Snapshot.SizeBytes)
		memory = resp.Snapshot.HasMemory
		addTimings(&at, resp.Timings)
		return d, nil
	})
	e.Progress.Finish()
	cleanup := e.deleteAll(ctx, "cleanup", ids, 1)
	for _, s := range snaps {
		if _, err := e.Client.DeleteSnapshot(context.WithoutCancel(ctx), &pb.DeleteSnapshotRequest{SnapshotId: s}); err != nil {
			cleanup = errors.Join(cleanup, err)
		}
	}
	if cleanup != nil {
		return nil, cleanup
	}
	r, err := d.result("snapshot", report.KindCube, p)
	if r != nil {
		r.Acts = &at
		if len(sizes) > 0 {
			slices.Sort(sizes)
			r.Notes = append(r.Notes, fmt.Sprintf("snapshot size (bytes its own files allocate), median of a chunk: %s; memory image: %v",
				report.Bytes(sizes[len(sizes)/2]).MiB(), memory))
		}
	}
	return r, err
}

// runClone snapshots one sandbox, then times N CloneSandbox calls of count
// sandboxes each (each call's clones are deleted before the next call).
func runClone(ctx context.Context, e *Env, p report.Params, name string, count int) (*report.Result, error) {
	ids, err := e.fill(ctx, name+": setup", 1, 1)
	if err != nil {
		return nil, err
	}
	snap, err := e.Client.SnapshotSandbox(ctx, &pb.SnapshotSandboxRequest{SandboxId: ids[0], Labels: map[string]string{LabelKey: e.RunID}})
	if err != nil {
		return nil, errors.Join(err, e.deleteAll(ctx, "cleanup", ids, 1))
	}
	var at report.ActionTimes
	e.Progress.Start(name, p.N)
	d := drive(ctx, e.Progress, p.N, 1, func(ctx context.Context, _ int) (time.Duration, error) {
		start := time.Now()
		resp, err := e.Client.CloneSandbox(ctx, &pb.CloneSandboxRequest{
			SnapshotId: snap.Snapshot.Id, Count: int32(count), Labels: map[string]string{LabelKey: e.RunID},
		})
		dur := time.Since(start)
		if err != nil {
			return 0, err
		}
		addTimings(&at, resp.Timings)
		var clones []string
		for _, s := range resp.Sandboxes {
			clones = append(clones, s.Id)
		}
		return dur, e.deleteAll(ctx, "", clones, 4)
	})
	e.Progress.Finish()
	cleanup := e.deleteAll(ctx, "cleanup", ids, 1)
	if _, err := e.Client.DeleteSnapshot(context.WithoutCancel(ctx), &pb.DeleteSnapshotRequest{SnapshotId: snap.Snapshot.Id}); err != nil {
		cleanup = errors.Join(cleanup, err)
	}
	if cleanup != nil {
		return nil, cleanup
	}
	r, err := d.result(name, report.KindCube, p)
	if r != nil {
		r.Acts = &at
	}
	return r, err
}
