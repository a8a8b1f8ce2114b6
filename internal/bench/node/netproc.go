package node

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/cubesandbox/cube/internal/serve"
)

// NetAgentProcess is the network-agent binary run as its own process for a
// private node, so that its memory can be read apart from the bench's (the
// density scenario's slots): a /16 of 16,384 slots, a pool of 4.
type NetAgentProcess struct {
	cmd    *exec.Cmd
	bin    string
	config string
	socket string
	dir    string
	exited chan error
	// waited is how the process ended, once something waited for it.
	waited error
}

// StartNetAgentProcess starts binDir's network-agent for the node of run
// runID in dir; its Close purges every slot and host rule.
func StartNetAgentProcess(ctx context.Context, runID, binDir, dir string) (*NetAgentProcess, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	n := &NetAgentProcess{bin: filepath.Join(binDir, "network-agent"), config: filepath.Join(dir, "network-agent.toml"),
		socket: filepath.Join(dir, "agent.sock"), dir: dir}
	var lastErr error
	// Another process on this host may hold the CIDR picked: the agent
	// refuses an overlap, so try other blocks.
	for try := 0; try < 5; try++ {
		toml := fmt.Sprintf(`node_cidr = %q
prefix = %q
run_dir = %q
data_dir = %q
[api]
socket = %q
http = ""
[pool]
size = 4
vm_size = 0
refill_per_second = 50.0
[dns]
log_queries = false
`, randomCIDR(16), "b"+runID[:min(7, len(runID))], filepath.Join(dir, "run"), filepath.Join(dir, "data"), n.socket)
		if err := os.WriteFile(n.config, []byte(toml), 0o600); err != nil {
			return nil, err
		}
		lastErr = n.start(ctx)
		if lastErr == nil || !strings.Contains(lastErr.Error(), "overlaps") {
			break
		}
	}
	if lastErr != nil {
		// An agent that got as far as its slots leaves them: purge.
		var purge error
		if out, err := exec.CommandContext(context.WithoutCancel(ctx), n.bin, "--config", n.config, "--purge").CombinedOutput(); err != nil {
			purge = fmt.Errorf("network-agent --purge: %w: %s", err, strings.TrimSpace(string(out)))
		}
		return nil, errors.Join(lastErr, purge, os.RemoveAll(dir))
	}
	return n, nil
}

func (n *NetAgentProcess) start(ctx context.Context) error {
	logPath := filepath.Join(n.dir, "network-agent.log")
	logf, err := os.Create(logPath)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.Command(n.bin, "--config", n.config)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start network-agent: %w", err)
	}
	n.cmd, n.exited = cmd, make(chan error, 1)
	go func() { n.exited <- cmd.Wait() }()
	deadline := time.Now().Add(20 * time.Second)
	for {
		if serve.Accepting(n.socket) {
			return nil
		}
		select {
		case err := <-n.exited:
			out, _ := os.ReadFile(logPath)
			return fmt.Errorf("network-agent exited (%v): %s", err, strings.TrimSpace(string(out)))
		case <-ctx.Done():
			_ = cmd.Process.Kill()
			n.waited = <-n.exited
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			n.waited = <-n.exited
			return errors.New("network-agent socket did not appear within 20s")
		}
	}
}

// Socket is the agent's API socket, for cubelet's [network] agent_socket.
func (n *NetAgentProcess) Socket() string { return n.socket }

// PID is the agent's process.
func (n *NetAgentProcess) PID() int { return n.cmd.Process.Pid }

// Close stops the agent and releases every slot and host rule; call it
// after cubelet has stopped (its sandboxes gave their slots back).
func (n *NetAgentProcess) Close(ctx context.Context) error {
	ctx = context.WithoutCancel(ctx)
	_ = n.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case n.waited = <-n.exited:
	case <-time.After(30 * time.Second):
		_ = n.cmd.Process.Kill()
		n.waited = <-n.exited
	}
	var errs []error
	if out, err := exec.CommandContext(ctx, n.bin, "--config", n.config, "--purge").CombinedOutput(); err != nil {
		errs = append(errs, fmt.Errorf("network-agent --purge: %w: %s", err, strings.TrimSpace(string(out))))
	}
	errs = append(errs, os.RemoveAll(n.dir))
	return errors.Join(errs...)
}
