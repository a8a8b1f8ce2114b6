package raw

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

// Podman is what a user would pick instead of cube on one machine:
// Debian's podman with runc, in storage of its own (--root/--runroot under
// the bench's work dir, overlay driver, cgroupfs, no events), so the run
// neither sees nor touches the host's containers.
type Podman struct {
	bin          string
	dir          string
	cgroupParent string
	agent        string
	global       []string
	ulimits      []string
}

// NewPodman sets podman's private storage up in dir (removed on Close)
// and loads the busybox image from dockerTar; containers run agent under
// cgroupParent.
func NewPodman(ctx context.Context, dir, cgroupParent, agent, dockerTar string) (*Podman, error) {
	bin, _ := exec.LookPath("podman")
	p := &Podman{
		bin:          bin,
		dir:          dir,
		cgroupParent: cgroupParent,
		agent:        agent,
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
	if _, err := p.Cmd(ctx, "load", "-q", "-i", dockerTar); err != nil {
		return nil, errors.Join(err, p.Close(ctx))
	}
	return p, nil
}

// CgroupParent is the cgroup its containers run under.
func (p *Podman) CgroupParent() string { return p.cgroupParent }

// Cmd runs one podman command on the private storage and returns its
// output.
func (p *Podman) Cmd(ctx context.Context, args ...string) (string, error) {
	full := append(append([]string{}, p.global...), args...)
	out, err := exec.CommandContext(ctx, p.bin, full...).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("podman %s: %w: %s", args[0], err, strings.TrimSpace(string(out)))
	}
	return strings.TrimSpace(string(out)), nil
}

// Run is `podman run -d --rm --net=none` of cube-agent (bind-mounted from
// the host, read-only) in the busybox image, then the first /health
// answer; it returns the container ID.
func (p *Podman) Run(ctx context.Context, i int) (string, time.Duration, error) {
	pidFile := filepath.Join(p.dir, "pid-"+strconv.Itoa(i))
	defer os.Remove(pidFile)
	args := []string{"run", "-d", "--rm", "--net=none", "--pidfile", pidFile,
		"--cgroup-parent", p.cgroupParent,
		"-v", p.agent + ":" + cubelet.AgentPath + ":ro"}
	args = append(args, p.ulimits...)
	args = append(args, testimage.BusyboxRef, cubelet.AgentPath, "--addr", ":"+strconv.Itoa(agentproto.Port))
	start := time.Now()
	id, err := p.Cmd(ctx, args...)
	if err != nil {
		return "", 0, err
	}
	pid, err := readPidFile(pidFile)
	if err != nil {
		return id, 0, err
	}
	if err := WaitAgent(ctx, pid); err != nil {
		return id, 0, err
	}
	return id, time.Since(start), nil
}

// Close removes every container, the image store and the directory.
func (p *Podman) Close(ctx context.Context) error {
	ctx = context.WithoutCancel(ctx)
	var errs []error
	if _, err := p.Cmd(ctx, "rm", "-a", "-f", "-t", "0"); err != nil {
		errs = append(errs, err)
	}
	if _, err := p.Cmd(ctx, "system", "reset", "-f"); err != nil {
		errs = append(errs, err)
	}
	// containers/storage bind-mounts its overlay dir on itself.
	for _, m := range []string{filepath.Join(p.dir, "root", "overlay"), filepath.Join(p.dir, "runroot")} {
		_ = unix.Unmount(m, unix.MNT_DETACH)
	}
	errs = append(errs, RemoveCgroupTree(p.cgroupParent))
	if err := os.RemoveAll(p.dir); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}
