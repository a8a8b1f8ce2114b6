package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/config"
	"github.com/cubesandbox/cube/internal/leakcheck"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/storage"
	"github.com/cubesandbox/cube/internal/testimage"
)

// node is a private cubelet with its own data dir (and loop-backed XFS
// pool), run dir, runc root and cgroup parent, like cubelettest's, so the
// suite never touches a real node's state.
type node struct {
	dir     string
	runtime string
	cfg     *config.Config
	svc     *cubelet.Service
	net     *netAgent // vm only: a VM's agent is reached through its slot
	log     *slog.Logger
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// startNode builds the agent (unless given), writes the config and
// starts cubelet in this process.
func startNode(ctx context.Context, agentBin, runtime string, log *slog.Logger) (*node, error) {
	id := randHex(4)
	dir := filepath.Join(os.TempDir(), "cube-e2e-node-"+id)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	n := &node{dir: dir, runtime: runtime, log: log}
	if agentBin == "" {
		agentBin = filepath.Join(dir, "cube-agent")
		cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-o", agentBin, "./cmd/cube-agent")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			n.remove()
			return nil, fmt.Errorf("build cube-agent (run from the repository root): %w\n%s", err, out)
		}
	}
	toml := fmt.Sprintf(`
[node]
id = "e2e-%[1]s"
data_dir = %[2]q
run_dir = %[3]q
cgroup_parent = "cube-e2e-%[1]s"
[api]
socket = %[4]q
tcp = ""
metrics = ""
[storage]
pool_image_size_mib = 2048
agent_binary = %[5]q
template_headroom_mib = 64
[gc]
interval = "200ms"
max_backoff = "2s"
`, id, filepath.Join(dir, "data"), filepath.Join(dir, "run"), filepath.Join(dir, "run", "cubelet.sock"), agentBin)
	if runtime != "runc" {
		extra, err := n.startVM(ctx)
		if err != nil {
			return nil, errors.Join(err, n.teardown(context.Background()))
		}
		toml += extra
	}
	cfg, err := config.Parse([]byte(toml))
	if err != nil {
		return nil, errors.Join(fmt.Errorf("config: %w", err), n.teardown(context.Background()))
	}
	n.cfg = cfg
	svc, err := cubelet.New(ctx, cfg, log)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("start cubelet: %w", err), n.teardown(context.Background()))
	}
	n.svc = svc
	return n, nil
}

// createSandbox imports the E2B-flavoured busybox template and creates
// one sandbox from it, with token as its agent's access token.
func (n *node) createSandbox(ctx context.Context, token string) (*sandbox.Record, error) {
	img := filepath.Join(n.dir, "e2b-busybox-oci")
	if err := testimage.WriteE2BBusybox(img); err != nil {
		return nil, fmt.Errorf("template image: %w", err)
	}
	if _, err := n.svc.ImportTemplate(ctx, "e2b-busybox", img, nil); err != nil {
		return nil, fmt.Errorf("import template: %w", err)
	}
	res, err := n.svc.Create(ctx, cubelet.CreateRequest{
		TemplateID:  "e2b-busybox",
		Labels:      map[string]string{"suite": "e2e-node"},
		Runtime:     n.runtime,
		Resources:   sandbox.Resources{MilliCPU: 1000, MemoryMiB: 512, Pids: 1024},
		AccessToken: token,
	})
	if err != nil {
		return nil, fmt.Errorf("create sandbox: %w", err)
	}
	return res.Sandbox, nil
}

func (n *node) scope() leakcheck.Scope {
	c := n.cfg
	return leakcheck.Scope{
		DataDir: c.Node.DataDir, RunDir: c.Node.RunDir, RuncRoot: c.Runc.Root, VMRoot: c.VM.Root, CgroupName: c.Node.CgroupParent,
		AllowMounts: []string{c.PoolDir()}, AllowLoopBacking: []string{c.PoolDir() + ".img"},
	}
}

// teardown deletes every sandbox through cubelet, checks that nothing
// leaked, then removes the pool and the directory. It returns the leaks
// and errors it found.
func (n *node) teardown(ctx context.Context) error {
	var errs []error
	if n.svc != nil {
		list, _ := n.svc.List(ctx, cubelet.ListFilter{})
		for _, sb := range list {
			if _, err := n.svc.Delete(ctx, sb.ID); err != nil {
				errs = append(errs, fmt.Errorf("delete %s: %w", sb.ID, err))
			}
		}
		n.svc.Close()
	}
	if n.cfg != nil {
		leaks, err := leakcheck.Check(ctx, n.scope())
		if err != nil {
			errs = append(errs, fmt.Errorf("leak check: %w", err))
		}
		for _, l := range leaks {
			errs = append(errs, fmt.Errorf("leaked %s", l))
		}
		n.forceClean(ctx)
		if p, err := storage.OpenPool(ctx, storage.PoolConfig{Dir: n.cfg.PoolDir(), ImageSizeBytes: 1 << 30}); err == nil {
			if err := p.Teardown(ctx); err != nil {
				errs = append(errs, fmt.Errorf("pool teardown: %w", err))
			}
		}
	}
	// After cubelet: its deletes release the slots.
	if n.net != nil {
		if err := n.net.close(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	n.remove()
	return errors.Join(errs...)
}

// forceClean is the safety net behind a failed delete: what a sandbox may
// still hold, removed without cubelet. It never replaces the leak check.
func (n *node) forceClean(ctx context.Context) {
	c := n.cfg
	if out, err := exec.CommandContext(ctx, c.Runc.Binary, "--root", c.Runc.Root, "list", "-q").Output(); err == nil {
		for _, id := range strings.Fields(string(out)) {
			_ = exec.CommandContext(ctx, c.Runc.Binary, "--root", c.Runc.Root, "delete", "--force", id).Run()
		}
	}
	killQEMU(c.Node.RunDir)
	runRoot := filepath.Join(c.Node.RunDir, "sandboxes")
	ents, _ := os.ReadDir(runRoot)
	for _, e := range ents {
		_ = storage.UnmountDisk(ctx, filepath.Join(runRoot, e.Name(), "rootfs"), filepath.Join(c.PoolDir(), "sandboxes", e.Name(), "disk.img"))
	}
	roots, _ := filepath.Glob("/sys/fs/cgroup/*")
	roots = append(roots, "/sys/fs/cgroup")
	for _, root := range roots {
		parent := filepath.Join(root, c.Node.CgroupParent)
		kids, _ := os.ReadDir(parent)
		for _, k := range kids {
			if k.IsDir() {
				_ = os.Remove(filepath.Join(parent, k.Name()))
			}
		}
		_ = os.Remove(parent)
	}
}

func (n *node) remove() { _ = os.RemoveAll(n.dir) }
