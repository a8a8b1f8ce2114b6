package cubelet

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"time"

	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/cubelet/config"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/nsdial"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/runc"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/storage"
	"github.com/cubesandbox/cube/internal/workflow"
)

// AgentPath is where templates carry the agent.
const AgentPath = "/usr/local/bin/cube-agent"

// node is what the actions share: filled in by the init flow, read-only
// afterwards.
type node struct {
	cfg     *config.Config
	pool    *storage.Pool
	drivers map[string]runtime.Driver
	// disks hands out ready template disks (diskpool.go); set after
	// reconcile, nil until then (creates clone inline).
	disks *storage.DiskPool
	// net is the network-agent client (network.go), dialled on first use.
	net netAgent
}

// bootsDisk: the runtime boots the sandbox disk itself (a VM), so
// cubelet does not mount it.
func (n *node) bootsDisk(runtime string) bool {
	d, ok := n.drivers[runtime]
	return ok && d.Capabilities().BootsDisk
}

func (n *node) driver(name string) (runtime.Driver, error) {
	d, ok := n.drivers[name]
	if !ok {
		return nil, fmt.Errorf("runtime %q is not available on this node: %w", name, errdefs.ErrInvalidArgument)
	}
	return d, nil
}

// registerActions lists every action cubelet knows. Flows in the config
// pick from these by name.
func registerActions(n *node, reg *workflow.Registry) {
	reg.MustRegister(
		&poolAction{n: n},
		&runtimesAction{n: n},
		&diskAction{n: n},
		&rootfsAction{n: n},
		&containerAction{n: n},
		&agentAction{n: n},
		&netAction{n: n},
	)
}

// poolAction opens the reflink storage pool (init).
type poolAction struct{ n *node }

func (*poolAction) Name() string { return "pool" }

func (a *poolAction) Init(ctx context.Context) error {
	c := a.n.cfg
	p, err := storage.OpenPool(ctx, storage.PoolConfig{
		Dir:            c.PoolDir(),
		ImageSizeBytes: c.Storage.PoolImageSizeMiB << 20,
		AllowCopy:      c.Storage.AllowCopy,
	})
	if err != nil {
		return err
	}
	a.n.pool = p
	return nil
}

// runtimesAction finds the runtime drivers this node can run (init).
type runtimesAction struct{ n *node }

func (*runtimesAction) Name() string { return "runtimes" }

func (a *runtimesAction) Init(ctx context.Context) error {
	c := a.n.cfg
	if _, err := exec.LookPath(c.Runc.Binary); err != nil {
		return fmt.Errorf("runc runtime: %w", err)
	}
	d, err := runc.New(runc.Config{Binary: c.Runc.Binary, Root: c.Runc.Root})
	if err != nil {
		return err
	}
	a.n.drivers = map[string]runtime.Driver{d.Name(): d}
	if g := a.gvisor(ctx); g != nil {
		a.n.drivers[g.Name()] = g
	}
	if v := a.vm(ctx); v != nil {
		a.n.drivers[v.Name()] = v
	}
	if _, ok := a.n.drivers[c.Node.DefaultRuntime]; !ok {
		return fmt.Errorf("node.default_runtime %q is not available: %w", c.Node.DefaultRuntime, errdefs.ErrInvalidArgument)
	}
	return nil
}

// diskAction gives the sandbox its own copy-on-write clone of the
// template image.
type diskAction struct{ n *node }

func (*diskAction) Name() string { return "disk" }

func (a *diskAction) Create(ctx context.Context, t *Task) error {
	rec := t.Record()
	path := a.n.pool.SandboxDiskPath(rec.ID)
	if err := t.Update(func(r *sandbox.Record) { r.Disk = &sandbox.Disk{Path: path} }); err != nil {
		return err
	}
	if err := a.n.templateDisk(ctx, t.Template, path); err != nil {
		return fmt.Errorf("clone template disk: %w", err)
	}
	if want := rec.Resources.DiskMiB << 20; want > 0 {
		if err := growExt4(ctx, path, want); err != nil {
			return err
		}
	}
	return nil
}

func (a *diskAction) Destroy(_ context.Context, t *Task) error {
	rec := t.Record()
	if rec.Disk == nil {
		return nil
	}
	if err := a.n.pool.RemoveSandboxDisk(rec.ID); err != nil {
		return err
	}
	return t.Update(func(r *sandbox.Record) { r.Disk = nil })
}

// growExt4 enlarges an unmounted ext4 image to size bytes; a smaller size
// than the image already has is left alone (shrinking would lose data).
func growExt4(ctx context.Context, path string, size int64) error {
	st, err := os.Stat(path)
	if err != nil {
		return err
	}
	if size <= st.Size() {
		return nil
	}
	if err := os.Truncate(path, size); err != nil {
		return fmt.Errorf("grow disk: %w", err)
	}
	out, err := exec.CommandContext(ctx, "resize2fs", "-f", path).CombinedOutput()
	if err != nil {
		return fmt.Errorf("resize2fs: %v: %s", err, out)
	}
	return nil
}

// rootfsAction loop-mounts the sandbox disk as the container's root.
type rootfsAction struct{ n *node }

func (*rootfsAction) Name() string { return "rootfs" }

func (a *rootfsAction) Create(ctx context.Context, t *Task) error {
	rec := t.Record()
	if rec.Disk == nil {
		return fmt.Errorf("rootfs: sandbox has no disk: %w", errdefs.ErrFailedPrecondition)
	}
	if a.n.bootsDisk(rec.Runtime) {
		return nil // the VM mounts its disk itself
	}
	target := filepath.Join(a.n.cfg.SandboxRunDir(rec.ID), "rootfs")
	if err := t.Update(func(r *sandbox.Record) {
		r.Mount = &sandbox.Mount{Target: target, Image: rec.Disk.Path}
	}); err != nil {
		return err
	}
	dev, err := storage.MountDisk(ctx, rec.Disk.Path, target, false)
	if err != nil {
		return err
	}
	return t.Update(func(r *sandbox.Record) { r.Mount.LoopDevice = dev })
}

func (a *rootfsAction) Destroy(ctx context.Context, t *Task) error {
	rec := t.Record()
	if rec.Mount == nil {
		return nil
	}
	if err := storage.UnmountDiskDev(ctx, rec.Mount.Target, rec.Mount.Image, rec.Mount.LoopDevice); err != nil {
		return err
	}
	removeIfEmpty(filepath.Dir(rec.Mount.Target))
	return t.Update(func(r *sandbox.Record) { r.Mount = nil })
}

// containerAction runs the sandbox's PID 1 (cube-agent) in its runtime.
type containerAction struct{ n *node }

func (*containerAction) Name() string { return "container" }

func (a *containerAction) Create(ctx context.Context, t *Task) error {
	rec := t.Record()
	d, err := a.n.driver(rec.Runtime)
	if err != nil {
		return err
	}
	if boots := d.Capabilities().BootsDisk; (boots && rec.Disk == nil) || (!boots && rec.Mount == nil) {
		return fmt.Errorf("container: sandbox has no root filesystem: %w", errdefs.ErrFailedPrecondition)
	}
	c := &sandbox.Container{
		ID:         rec.ID,
		Bundle:     filepath.Join(a.n.cfg.SandboxRunDir(rec.ID), "bundle"),
		CgroupPath: a.n.cfg.CgroupPath(rec.ID),
	}
	if err := t.Update(func(r *sandbox.Record) { r.Container = c }); err != nil {
		return err
	}
	if err := os.MkdirAll(c.Bundle, 0o700); err != nil {
		return err
	}
	spec := a.spec(rec, c, t.Template)
	// Checked again right before the bind: a path component may have
	// become a symlink since create validated it.
	if spec.Mounts, err = a.n.hostMountsFor(rec.HostMounts); err != nil {
		return err
	}
	if m, ok := a.n.sharedAgent(); ok && !d.Capabilities().BootsDisk {
		spec.Mounts = append(spec.Mounts, m)
	}
	st, err := launch(ctx, d, t, spec)
	if err != nil {
		return err
	}
	return t.Update(func(r *sandbox.Record) { r.Container.PID = st.PID })
}

func (a *containerAction) spec(rec *sandbox.Record, c *sandbox.Container, tmpl *sandbox.Template) runtime.Spec {
	env := append([]string(nil), tmpl.Env...)
	if len(env) == 0 {
		env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	}
	for k, v := range rec.Env {
		env = append(env, k+"="+v)
	}
	env = append(env, agentproto.EnvSandboxID+"="+rec.ID, agentproto.EnvTemplateID+"="+rec.TemplateID)
	var rootfs, disk string
	if rec.Mount != nil {
		rootfs = rec.Mount.Target
	} else if rec.Disk != nil {
		disk = rec.Disk.Path
	}
	return runtime.Spec{
		ID:         c.ID,
		BundleDir:  c.Bundle,
		RootFS:     rootfs,
		Disk:       disk,
		Args:       []string{AgentPath, "--addr", ":" + strconv.Itoa(agentproto.Port)},
		Env:        env,
		Cwd:        "/",
		Hostname:   rec.ID,
		CgroupPath: c.CgroupPath,
		NetNSPath:  rec.Network.RuntimeNetNS(),
		Limits: runtime.Limits{
			MilliCPU:  rec.Resources.MilliCPU,
			MemoryMiB: rec.Resources.MemoryMiB,
			Pids:      rec.Resources.Pids,
		},
		Labels: rec.Labels,
	}
}

func (a *containerAction) Destroy(ctx context.Context, t *Task) error {
	rec := t.Record()
	if rec.Container == nil {
		return nil
	}
	d, err := a.n.driver(rec.Runtime)
	if err != nil {
		return err
	}
	if err := d.Stop(ctx, rec.Container.ID); err != nil {
		return err
	}
	if err := os.RemoveAll(rec.Container.Bundle); err != nil {
		return err
	}
	removeIfEmpty(filepath.Dir(rec.Container.Bundle))
	return t.Update(func(r *sandbox.Record) { r.Container = nil })
}

func (a *containerAction) Pause(ctx context.Context, t *Task) error {
	rec := t.Record()
	d, err := a.n.driver(rec.Runtime)
	if err != nil {
		return err
	}
	return settle(ctx, d, rec.Container.ID, runtime.StatusPaused, d.Pause(ctx, rec.Container.ID))
}

func (a *containerAction) Resume(ctx context.Context, t *Task) error {
	rec := t.Record()
	d, err := a.n.driver(rec.Runtime)
	if err != nil {
		return err
	}
	return settle(ctx, d, rec.Container.ID, runtime.StatusRunning, d.Resume(ctx, rec.Container.ID))
}

// settle makes pause and resume idempotent without an extra runtime call
// on the hot path: only when the verb failed does it ask whether the
// sandbox is already where the caller wants it (an undo of a verb that
// never ran, or a retry after a crash).
func settle(ctx context.Context, d runtime.Driver, id string, want runtime.Status, err error) error {
	if err == nil {
		return nil
	}
	if st, serr := d.State(ctx, id); serr == nil && st.Status == want {
		return nil
	}
	return err
}

// agentAction waits until cube-agent answers /health inside the sandbox:
// a sandbox is Running only when its agent is.
type agentAction struct{ n *node }

func (*agentAction) Name() string { return "agent" }

// Create waits for the agent; a VM's is then given its environment (its
// kernel starts it with none).
func (a *agentAction) Create(ctx context.Context, t *Task) error {
	if err := a.wait(ctx, t); err != nil {
		return err
	}
	if a.n.bootsDisk(t.Record().Runtime) {
		return a.n.reinitAgent(ctx, t)
	}
	return nil
}
func (a *agentAction) Resume(ctx context.Context, t *Task) error { return a.wait(ctx, t) }

// Destroy has nothing to release: the agent dies with the container.
func (a *agentAction) Destroy(context.Context, *Task) error { return nil }

func (a *agentAction) wait(ctx context.Context, t *Task) error {
	ctx, cancel := context.WithTimeout(ctx, a.n.cfg.Sandbox.AgentReadyTimeout.Duration)
	defer cancel()
	rec := t.Record()
	err := a.n.waitAgent(ctx, rec)
	if err != nil && rec.Container != nil {
		return a.n.withConsole(rec, err)
	}
	if err == nil {
		a.n.sealConsole(ctx, rec)
	}
	return err
}

// consoleSealer is a driver whose console file must stop growing once the
// sandbox is up (VMs: guest root writes the serial port at will).
type consoleSealer interface {
	SealConsole(ctx context.Context, id string) error
}

// sealConsole switches a VM's console away from its file once the agent
// answered. A failure is logged, not fatal: the sandbox works either way.
func (n *node) sealConsole(ctx context.Context, rec *sandbox.Record) {
	d, err := n.driver(rec.Runtime)
	if err != nil {
		return
	}
	if c, ok := d.(consoleSealer); ok {
		if err := c.SealConsole(ctx, rec.Container.ID); err != nil {
			slog.WarnContext(ctx, "seal VM console", "sandbox_id", rec.ID, "error", err)
		}
	}
}

// consoleLogger is a driver that keeps a sandbox's console in a file (VMs:
// the serial console).
type consoleLogger interface {
	ConsoleLog(id string) (string, error)
}

// withConsole adds the tail of a VM's serial console to an agent error:
// a guest that never reached its agent says why there (kernel panic,
// missing module, init failure), and the bundle holding it is removed by
// the undo that follows.
func (n *node) withConsole(rec *sandbox.Record, err error) error {
	d, derr := n.driver(rec.Runtime)
	if derr != nil {
		return err
	}
	c, ok := d.(consoleLogger)
	if !ok {
		return err
	}
	path, cerr := c.ConsoleLog(rec.Container.ID)
	if cerr != nil {
		return err
	}
	b, _ := os.ReadFile(path)
	if len(b) > 2048 {
		b = b[len(b)-2048:]
	}
	if len(b) == 0 {
		return err
	}
	return fmt.Errorf("%w; guest console ends with:\n%s", err, b)
}

// WaitAgent polls the agent's /health in the network namespace of pid
// until it answers, the process dies, or ctx ends.
func WaitAgent(ctx context.Context, pid int) error {
	client := nsdial.HTTPClient(fmt.Sprintf("/proc/%d/ns/net", pid))
	return pollHealth(ctx, client, fmt.Sprintf("http://127.0.0.1:%d/health", agentproto.Port), pid)
}

// pollHealth GETs url with a doubling delay (1 ms to 20 ms) until it
// answers 2xx, the sandbox's init (pid) dies, or ctx ends. Both ways of
// reaching the agent (its netns, or its slot's host IP) use it.
func pollHealth(ctx context.Context, client *http.Client, url string, pid int) error {
	defer client.CloseIdleConnections()
	delay := time.Millisecond
	var last error
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		resp, err := client.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode/100 == 2 {
				return nil
			}
			err = fmt.Errorf("health answered %s", resp.Status)
		}
		last = err
		if _, serr := os.Stat(fmt.Sprintf("/proc/%d", pid)); errors.Is(serr, os.ErrNotExist) {
			return fmt.Errorf("agent: sandbox init (pid %d) exited before answering: %w", pid, errdefs.ErrUnavailable)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("agent not ready at %s: %v (last: %v): %w", url, ctx.Err(), last, errdefs.ErrUnavailable)
		case <-time.After(delay):
		}
		if delay < 20*time.Millisecond {
			delay *= 2
		}
	}
}

// removeIfEmpty removes a sandbox's run directory once the last thing in
// it (bundle or rootfs mount point) is gone; whichever destroy runs last
// gets it. ENOTEMPTY means another resource is still there: not an error.
func removeIfEmpty(dir string) { _ = os.Remove(dir) }

// sharedAgent is the read-only bind of the node's cube-agent over the
// template's copy: the sandbox's disk copy of the binary would otherwise
// be cached once per sandbox (its own file) and again under the loop
// device's backing file. Skipped when the binary is missing, so a node
// whose agent_binary went away still boots sandboxes from the template.
func (n *node) sharedAgent() (runtime.Mount, bool) {
	c := n.cfg.Storage
	if !c.ShareAgentBinary || c.AgentBinary == "" {
		return runtime.Mount{}, false
	}
	if st, err := os.Stat(c.AgentBinary); err != nil || !st.Mode().IsRegular() {
		return runtime.Mount{}, false
	}
	return runtime.Mount{Source: c.AgentBinary, Destination: AgentPath, ReadOnly: true}, true
}
