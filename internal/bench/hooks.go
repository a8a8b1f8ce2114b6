package bench

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"slices"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
)

// Hooks for what lands later: the gVisor and VM runtimes' raw restore
// baselines, snapshots and clones (issue 3) and the E2B round trip
// (cubemaster + cubeproxy). Each probes the node and skips with the reason
// until the thing it measures exists; none of them fakes a number.

// hasRuntime reports whether the cubelet offers runtime rt.
func hasRuntime(ctx context.Context, e *Env, rt string) error {
	info, err := e.Info(ctx)
	if err != nil {
		return err
	}
	var names []string
	for _, r := range info.Runtimes {
		names = append(names, r.Name)
	}
	if !slices.Contains(names, rt) {
		return skipf("cubelet offers runtimes %v, not %s", names, rt)
	}
	return nil
}

// implemented probes an RPC with an empty request: a cubelet that has it
// answers InvalidArgument (or NotFound), one that does not answers
// Unimplemented.
func implemented(ctx context.Context, rpc string, call func(context.Context) error) error {
	err := call(ctx)
	if status.Code(err) == codes.Unimplemented {
		return skipf("cubelet does not implement %s yet", rpc)
	}
	if err != nil && status.Code(err) == codes.Unavailable {
		return fmt.Errorf("probe %s: %w", rpc, err)
	}
	return nil
}

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
	for _, h := range []struct{ name, rt, bin, help string }{
		{"runsc-restore", "gvisor", "runsc", "bare `runsc restore` of the template's warm checkpoint + first /health"},
		{"qemu-incoming", "vm", "qemu-system-x86_64", "bare `qemu -incoming` of the template's warm snapshot + first /health"},
	} {
		Register(Scenario{
			Name: h.name, Kind: KindBaseline, Runtime: h.rt, Help: h.help,
			Params: func(o Options) Params { return Params{N: o.N1, Concurrency: 1} },
			Probe: func(ctx context.Context, e *Env) error {
				if err := hasRuntime(ctx, e, h.rt); err != nil {
					return err
				}
				if _, err := exec.LookPath(h.bin); err != nil {
					return skipf("%s is not installed", h.bin)
				}
				return nil
			},
			Run: func(context.Context, *Env, Params) (*Result, error) {
				return nil, skipf("the %s baseline comes with the %s runtime driver", h.name, h.rt)
			},
		})
	}

	Register(Scenario{
		Name: "snapshot", Kind: KindCube,
		Help:      "SnapshotSandbox of a running sandbox (disk; memory where the runtime can checkpoint)",
		Baselines: []string{"reflink-copy"},
		Params:    func(o Options) Params { return Params{N: o.SnapshotN, Concurrency: 1} },
		Probe:     probeSnapshot,
		Run:       runSnapshot,
	})
	Register(Scenario{
		Name: "clone-1", Kind: KindCube,
		Help:      "CloneSandbox of one sandbox from a snapshot, until its agent answers",
		Baselines: []string{"runc-run", "runsc-restore", "qemu-incoming"},
		Params:    func(o Options) Params { return Params{N: o.SnapshotN, Concurrency: 1} },
		Probe:     probeClone,
		Run: func(ctx context.Context, e *Env, p Params) (*Result, error) {
			return runClone(ctx, e, p, "clone-1", 1)
		},
	})
	Register(Scenario{
		Name: "clone-n", Kind: KindCube,
		Help:   "CloneSandbox of --clone-count sandboxes in one call (latency per call)",
		Params: func(o Options) Params { return Params{N: max(1, o.SnapshotN/5), Concurrency: 1} },
		Probe:  probeClone,
		Run: func(ctx context.Context, e *Env, p Params) (*Result, error) {
			return runClone(ctx, e, p, "clone-n", e.Opts.CloneCount)
		},
	})
	Register(Scenario{
		Name: "reflink-copy", Kind: KindBaseline,
		Help:   "raw FICLONE of a template-sized disk image (a runc snapshot is a disk clone)",
		Params: func(o Options) Params { return Params{N: o.SnapshotN, Concurrency: 1} },
		Probe:  probeRaw,
		Run:    runReflinkCopy,
	})
	Register(Scenario{
		Name: "e2b", Kind: KindCube,
		Help:      "E2B round trip: POST /sandboxes on the E2B API, first envd /health through cubeproxy, DELETE",
		Baselines: []string{"runc-run", "podman-run"},
		Params:    func(o Options) Params { return Params{N: o.N1, Concurrency: 1} },
		Probe: func(context.Context, *Env) error {
			return skipf("needs cubemaster's E2B API and cubeproxy, which are not in this tree yet")
		},
		Run: func(context.Context, *Env, Params) (*Result, error) {
			return nil, skipf("E2B round trip not available")
		},
	})
}

// runSnapshot times SnapshotSandbox of one running sandbox N times, then
// removes the snapshots and the sandbox.
func runSnapshot(ctx context.Context, e *Env, p Params) (*Result, error) {
	ids, err := e.fill(ctx, "snapshot: setup", 1, 1)
	if err != nil {
		return nil, err
	}
	var snaps []string
	var at actionTimes
	e.Progress.Start("snapshot", p.N)
	d := drive(ctx, e.Progress, p.N, 1, func(ctx context.Context, _ int) (time.Duration, error) {
		start := time.Now()
		resp, err := e.Client.SnapshotSandbox(ctx, &pb.SnapshotSandboxRequest{SandboxId: ids[0], Labels: map[string]string{LabelKey: e.RunID}})
		if err != nil {
			return 0, err
		}
		d := time.Since(start)
		snaps = append(snaps, resp.Snapshot.Id)
		at.add(resp.Timings)
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
	r, err := d.result("snapshot", KindCube, p)
	if r != nil {
		r.acts = &at
	}
	return r, err
}

// runClone snapshots one sandbox, then times N CloneSandbox calls of count
// sandboxes each (each call's clones are deleted before the next call).
func runClone(ctx context.Context, e *Env, p Params, name string, count int) (*Result, error) {
	ids, err := e.fill(ctx, name+": setup", 1, 1)
	if err != nil {
		return nil, err
	}
	snap, err := e.Client.SnapshotSandbox(ctx, &pb.SnapshotSandboxRequest{SandboxId: ids[0], Labels: map[string]string{LabelKey: e.RunID}})
	if err != nil {
		return nil, errors.Join(err, e.deleteAll(ctx, "cleanup", ids, 1))
	}
	var at actionTimes
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
		at.add(resp.Timings)
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
	r, err := d.result(name, KindCube, p)
	if r != nil {
		r.acts = &at
	}
	return r, err
}
