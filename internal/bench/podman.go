package bench

import (
	"context"
	"errors"
	"os/exec"
	"time"

	"github.com/cubesandbox/cube/internal/bench/raw"
	"github.com/cubesandbox/cube/internal/bench/report"
)

// The podman baseline: what a user would pick instead of cube on one
// machine (raw.Podman), timed from `podman run` to the first /health.

func probePodman(ctx context.Context, e *Env) error {
	if _, err := exec.LookPath("podman"); err != nil {
		return skipf("podman is not installed (hack/deps.sh installs it)")
	}
	if e.Opts.DockerTar == "" || e.Opts.AgentBinary == "" {
		return skipf("podman baseline needs the busybox docker-archive and the cube-agent binary")
	}
	return nil
}

// podman sets podman's private storage up once per Env.
func (e *Env) podman(ctx context.Context) (*raw.Podman, error) {
	e.podOnce.Do(func() { e.pod, e.podErr = e.newPodman(ctx) })
	return e.pod, e.podErr
}

func (e *Env) newPodman(ctx context.Context) (*raw.Podman, error) {
	if err := probePodman(ctx, e); err != nil {
		return nil, err
	}
	dir, err := e.scratch("podman")
	if err != nil {
		return nil, err
	}
	return raw.NewPodman(ctx, dir, "/cube-bench-pod-"+e.RunID, e.Opts.AgentBinary, e.Opts.DockerTar)
}

func init() {
	Register(Scenario{
		Name: "podman-run", Kind: report.KindBaseline, Runtime: "runc",
		Help:   "`podman run -d --rm --net=none` of cube-agent in the busybox image + first /health answer",
		Params: func(o report.Options) report.Params { return report.Params{N: o.N1, Concurrency: 1} },
		Probe:  probePodman,
		Run: func(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
			pm, err := e.podman(ctx)
			if err != nil {
				return nil, err
			}
			e.Progress.Start("podman-run", p.N)
			d := drive(ctx, e.Progress, p.N, p.Concurrency, func(ctx context.Context, i int) (time.Duration, error) {
				id, dur, err := pm.Run(ctx, i)
				if id != "" {
					if _, rerr := pm.Cmd(context.WithoutCancel(ctx), "rm", "-f", "-t", "0", id); rerr != nil {
						err = errors.Join(err, rerr)
					}
				}
				return dur, err
			})
			e.Progress.Finish()
			return d.result("podman-run", report.KindBaseline, p)
		},
	})
}
