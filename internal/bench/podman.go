package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/testimage"
)

// podman is what a user would pick instead of cube on one machine:
// Debian's podman with runc, in storage of its own (--root/--runroot under
// the bench's work dir, overlay driver, cgroupfs, no events), so the run
// neither sees nor touches the host's containers.
type podman struct {
	bin          string
	dir          string
	cgroupParent string
	agent        string
	global       []string
	ulimits      []string
}

func probePodman(ctx context.Context, e *Env) error {
	if _, err := exec.LookPath("podman"); err != nil {
		return skipf("podman is not installed (hack/deps.sh installs it)")
	}
	if e.Opts.DockerTar == "" || e.Opts.AgentBinary == "" {
		return skipf("podman baseline needs the busybox docker-archive and the cube-agent binary")
	}
	return nil
}

func (e *Env) podman(ctx context.Context) (*podman, error) {
	e.podOnce.Do(func() { e.pod, e.podErr = e.newPodman(ctx) })
	return e.pod, e.podErr
}

func (e *Env) newPodman(ctx context.Context) (*podman, error) {
	if err := probePodman(ctx, e); err != nil {
		return nil, err
	}
	bin, _ := exec.LookPath("podman")
	dir, err := e.scratch("podman")
	if err != nil {
		return nil, err
	}
	p := &podman{
		bin:          bin,
		dir:          dir,
		cgroupParent: "/cube-bench-pod-" + e.RunID,
		agent:        e.Opts.AgentBinary,
		global: []string{
			"--root", filepath.Join(dir, "root"),
			"--runroot", filepath.Join(dir, "runroot"),
			"--tmpdir", filepath.Join(dir, "tmp"),
			"--storage-driver", "overlay",
			"--cgroup-manager", "cgroupfs",
			"--events-backend", "none",
			"--runtime", "runc",
		},
	}
	// podman asks runc for RLIMIT_NOFILE/NPROC of 1048576/4194304; without
	// CAP_SYS_RESOURCE runc cannot set limits above its own hard ones and
	// the container fails, so ask for what this host allows (cube's runc
	// driver lowers NOFILE the same way).
	var nofile unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &nofile) == nil && nofile.Max != unix.RLIM_INFINITY {
		p.ulimits = append(p.ulimits, "--ulimit", fmt.Sprintf("nofile=%d:%d", nofile.Max, nofile.Max))
	}
	// conmon starts runc with NPROC capped at 32768 on this kind of host.
	p.ulimits = append(p.ulimits, "--ulimit", "nproc=4096:4096")
	if _, err := p.cmd(ctx, "load", "-q", "-i", e.Opts.DockerTar); err != nil {
		return nil, errors.Join(err, p.close(ctx))
	}
	return p, nil
}

func (p *podman) cmd(ctx context.Context, args ...string) (string, error) {
	full := append(append([]string{}, p.global...), args...)
	out, err := exec.CommandContext(ctx, p.bin, full...).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("podman %s: %w: %s", args[0], err, strings.TrimSpace(string(out)))
	}
	return strings.TrimSpace(string(out)), nil
}

// run is `podman run -d --rm --net=none` of cube-agent (bind-mounted from
// the host, read-only) in the busybox image, then the first /health
// answer; it returns the container ID.
func (p *podman) run(ctx context.Context, i int) (string, time.Duration, error) {
	pidFile := filepath.Join(p.dir, "pid-"+strconv.Itoa(i))
	defer os.Remove(pidFile)
	args := []string{"run", "-d", "--rm", "--net=none", "--pidfile", pidFile,
		"--cgroup-parent", p.cgroupParent,
		"-v", p.agent + ":" + cubelet.AgentPath + ":ro"}
	args = append(args, p.ulimits...)
	args = append(args, testimage.BusyboxRef, cubelet.AgentPath, "--addr", ":"+strconv.Itoa(agentproto.Port))
	start := time.Now()
	id, err := p.cmd(ctx, args...)
	if err != nil {
		return "", 0, err
	}
	pid, err := readPidFile(pidFile)
	if err != nil {
		return id, 0, err
	}
	if err := waitAgent(ctx, pid); err != nil {
		return id, 0, err
	}
	return id, time.Since(start), nil
}

// close removes every container, the image store and the directory.
func (p *podman) close(ctx context.Context) error {
	ctx = context.WithoutCancel(ctx)
	var errs []error
	if _, err := p.cmd(ctx, "rm", "-a", "-f", "-t", "0"); err != nil {
		errs = append(errs, err)
	}
	if _, err := p.cmd(ctx, "system", "reset", "-f"); err != nil {
		errs = append(errs, err)
	}
	// containers/storage bind-mounts its overlay dir on itself.
	for _, m := range []string{filepath.Join(p.dir, "root", "overlay"), filepath.Join(p.dir, "runroot")} {
		_ = unix.Unmount(m, unix.MNT_DETACH)
	}
	errs = append(errs, removeCgroupTree(p.cgroupParent))
	if err := os.RemoveAll(p.dir); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

func init() {
	Register(Scenario{
		Name: "podman-run", Kind: KindBaseline, Runtime: "runc",
		Help:   "`podman run -d --rm --net=none` of cube-agent in the busybox image + first /health answer",
		Params: func(o Options) Params { return Params{N: o.N1, Concurrency: 1} },
		Probe:  probePodman,
		Run: func(ctx context.Context, e *Env, p Params) (*Result, error) {
			pm, err := e.podman(ctx)
			if err != nil {
				return nil, err
			}
			e.Progress.Start("podman-run", p.N)
			d := drive(ctx, e.Progress, p.N, p.Concurrency, func(ctx context.Context, i int) (time.Duration, error) {
				id, dur, err := pm.run(ctx, i)
				if id != "" {
					if _, rerr := pm.cmd(context.WithoutCancel(ctx), "rm", "-f", "-t", "0", id); rerr != nil {
						err = errors.Join(err, rerr)
					}
				}
				return dur, err
			})
			e.Progress.Finish()
			return d.result("podman-run", KindBaseline, p)
		},
	})
}
