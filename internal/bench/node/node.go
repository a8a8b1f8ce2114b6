// Package node starts and removes the private cubelet cube-bench drives
// by default: a cubelet process on private data and run directories (its
// own reflink pool, store, runc root, cgroup parent, socket and metrics
// listener with pprof on) and, for the gvisor and vm runtimes, the
// network-agent it needs (served in-process) and the VM guest. Nothing
// of it is shared with a cubelet already on the host.
package node

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/bench/raw"
	"github.com/cubesandbox/cube/internal/cubeletclient"
	"github.com/cubesandbox/cube/internal/leakcheck"
	"github.com/cubesandbox/cube/internal/storage"
)

// Config says how to start a private cubelet.
type Config struct {
	RunID       string
	BinDir      string // holds the cubelet and cube-agent binaries
	Dir         string // everything the node makes lives under it
	PoolSizeMiB int64  // apparent size of its loop-backed XFS pool (sparse)
	ExtraTOML   string // appended to the generated config
}

// Node is a cubelet process the bench started in private directories: its
// own data and run dirs (and so its own reflink pool, store and runc
// root), its own cgroup parent, its socket, and a metrics listener with
// pprof on. Nothing of it is shared with a cubelet already on the host.
type Node struct {
	Dir          string
	ConfigPath   string
	Socket       string
	MetricsURL   string
	DataDir      string
	RunDir       string
	CgroupParent string

	binDir string
	cmd    *exec.Cmd
	exited chan error
	conn   *grpc.ClientConn
	Client pb.CubeletServiceClient
}

// Start writes a config and starts cubelet, returning once its API
// answers.
func Start(ctx context.Context, cfg Config) (n *Node, err error) {
	bin := filepath.Join(cfg.BinDir, "cubelet")
	agent := filepath.Join(cfg.BinDir, "cube-agent")
	for _, f := range []string{bin, agent} {
		if _, err := os.Stat(f); err != nil {
			return nil, fmt.Errorf("bench node: %w (run make build, or pass --bin-dir)", err)
		}
	}
	if cfg.PoolSizeMiB == 0 {
		cfg.PoolSizeMiB = 16384
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	n = &Node{
		Dir:          cfg.Dir,
		DataDir:      filepath.Join(cfg.Dir, "data"),
		RunDir:       filepath.Join(cfg.Dir, "run"),
		Socket:       filepath.Join(cfg.Dir, "run", "cubelet.sock"),
		MetricsURL:   "http://" + port,
		CgroupParent: "cube-bench-" + cfg.RunID,
		ConfigPath:   filepath.Join(cfg.Dir, "cubelet.toml"),
		binDir:       cfg.BinDir,
	}
	if err := os.MkdirAll(cfg.Dir, 0o755); err != nil {
		return nil, err
	}
	toml := fmt.Sprintf(`[node]
id = "bench-%s"
data_dir = %q
run_dir = %q
cgroup_parent = %q
[api]
socket = %q
tcp = ""
metrics = %q
pprof = true
[storage]
pool_image_size_mib = %d
agent_binary = %q
%s
`, cfg.RunID, n.DataDir, n.RunDir, n.CgroupParent, n.Socket, port, cfg.PoolSizeMiB, agent, cfg.ExtraTOML)
	if err := os.WriteFile(n.ConfigPath, []byte(toml), 0o644); err != nil {
		return nil, err
	}
	logf, err := os.Create(filepath.Join(cfg.Dir, "cubelet.log"))
	if err != nil {
		return nil, err
	}
	defer logf.Close() // the child has its own copy
	n.cmd = exec.Command(bin, "--config", n.ConfigPath)
	n.cmd.Stdout, n.cmd.Stderr = logf, logf
	// Own process group: a Ctrl-C meant for cube-bench must not kill
	// cubelet before the bench has removed its sandboxes through it.
	n.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := n.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start cubelet: %w", err)
	}
	cmd, exited := n.cmd, make(chan error, 1)
	n.exited = exited
	go func() { exited <- cmd.Wait() }()
	defer func() {
		if err != nil {
			err = errors.Join(err, n.Stop(context.WithoutCancel(ctx)), n.Teardown(context.WithoutCancel(ctx)))
		}
	}()
	if n.conn, err = cubeletclient.Dial(n.Socket); err != nil {
		return n, err
	}
	n.Client = cubeletclient.New(n.conn)
	err = n.waitHealthy(ctx)
	return n, err
}

// Kill SIGKILLs cubelet (a crash: its sandboxes keep running) and waits
// until it is gone.
func (n *Node) Kill() error {
	if n.cmd == nil || n.cmd.Process == nil {
		return errors.New("bench node: cubelet is not running")
	}
	if err := n.cmd.Process.Kill(); err != nil {
		return fmt.Errorf("kill cubelet: %w", err)
	}
	<-n.exited //nolint:errcheck // killed: the status is the signal
	n.cmd = nil
	return nil
}

// Restart starts a killed cubelet again with the same config, as a
// supervisor would, and returns once its API answers (the node's client
// reconnects by itself).
func (n *Node) Restart(ctx context.Context) error {
	if n.cmd != nil {
		return errors.New("bench node: cubelet is running")
	}
	logf, err := os.OpenFile(filepath.Join(n.Dir, "cubelet.log"), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		return err
	}
	defer logf.Close()
	bin := filepath.Join(n.binDir, "cubelet")
	n.cmd = exec.Command(bin, "--config", n.ConfigPath)
	n.cmd.Stdout, n.cmd.Stderr = logf, logf
	n.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := n.cmd.Start(); err != nil {
		n.cmd = nil
		return fmt.Errorf("restart cubelet: %w", err)
	}
	cmd, exited := n.cmd, make(chan error, 1)
	n.exited = exited
	go func() { exited <- cmd.Wait() }()
	return n.waitHealthy(ctx)
}

// waitHealthy polls the API until it answers, cubelet exits, or 2m pass.
func (n *Node) waitHealthy(ctx context.Context) error {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		hctx, cancel := context.WithTimeout(ctx, time.Second)
		_, herr := n.Client.Health(hctx, &pb.HealthRequest{})
		cancel()
		if herr == nil {
			return nil
		}
		select {
		case werr := <-n.exited:
			n.exited <- werr
			return fmt.Errorf("cubelet exited during start-up (%v): %s", werr, raw.Tail(filepath.Join(n.Dir, "cubelet.log")))
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("cubelet did not answer within 2m: %v", herr)
		}
	}
}

// PID is the cubelet process's PID.
func (n *Node) PID() int { return n.cmd.Process.Pid }

// Stop deletes every sandbox through the API, then stops cubelet.
func (n *Node) Stop(ctx context.Context) error {
	var errs []error
	if n.Client != nil {
		if resp, err := n.Client.ListSandboxes(ctx, &pb.ListSandboxesRequest{}); err == nil {
			for _, s := range resp.Sandboxes {
				if _, err := n.Client.DeleteSandbox(ctx, &pb.DeleteSandboxRequest{SandboxId: s.Id}); err != nil {
					errs = append(errs, err)
				}
			}
		}
	}
	if n.conn != nil {
		n.conn.Close()
	}
	if n.cmd != nil && n.cmd.Process != nil {
		_ = n.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-n.exited: //nolint:errcheck // its exit status after SIGTERM says nothing
		case <-time.After(15 * time.Second):
			_ = n.cmd.Process.Kill()
			<-n.exited //nolint:errcheck // killed: the status is the signal
			errs = append(errs, errors.New("cubelet ignored SIGTERM for 15s; killed"))
		}
		n.cmd = nil
	}
	return errors.Join(errs...)
}

// Scope is what the leak checker inspects for this node.
func (n *Node) Scope() leakcheck.Scope {
	pool := filepath.Join(n.DataDir, "pool")
	return leakcheck.Scope{
		DataDir: n.DataDir, RunDir: n.RunDir, RuncRoot: filepath.Join(n.RunDir, "runc"),
		RunscRoot: filepath.Join(n.RunDir, "runsc"), VMRoot: filepath.Join(n.RunDir, "vm"),
		CgroupName: n.CgroupParent, AllowMounts: []string{pool}, AllowLoopBacking: []string{pool + ".img"},
	}
}

// Teardown removes, without cubelet, whatever its sandboxes may still
// hold (a safety net behind Stop), then the pool and the directory.
func (n *Node) Teardown(ctx context.Context) error {
	var errs []error
	runcRoot := filepath.Join(n.RunDir, "runc")
	if out, err := exec.CommandContext(ctx, "runc", "--root", runcRoot, "list", "-q").Output(); err == nil {
		for _, id := range strings.Fields(string(out)) {
			_ = exec.CommandContext(ctx, "runc", "--root", runcRoot, "delete", "--force", id).Run()
		}
	}
	pool := filepath.Join(n.DataDir, "pool")
	ents, _ := os.ReadDir(filepath.Join(n.RunDir, "sandboxes"))
	for _, ent := range ents {
		errs = append(errs, storage.UnmountDisk(ctx, filepath.Join(n.RunDir, "sandboxes", ent.Name(), "rootfs"),
			filepath.Join(pool, "sandboxes", ent.Name(), "disk.img")))
	}
	errs = append(errs, raw.RemoveCgroupTree("/"+n.CgroupParent))
	// Only a mounted pool: opening an unmounted one would make a new image.
	if mounted, _ := storage.IsMounted(pool); mounted {
		if p, err := storage.OpenPool(ctx, storage.PoolConfig{Dir: pool, ImageSizeBytes: 1 << 30}); err == nil {
			errs = append(errs, p.Teardown(ctx), raw.WaitLoopGone(pool+".img", raw.LoopGoneWait))
		}
	}
	if err := os.RemoveAll(n.Dir); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

func freePort() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	addr := l.Addr().String()
	return addr, l.Close()
}
