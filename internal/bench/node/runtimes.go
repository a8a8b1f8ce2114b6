package node

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/cubesandbox/cube/internal/leakcheck"
	"github.com/cubesandbox/cube/internal/network/agent"
	"github.com/cubesandbox/cube/internal/network/agentapi"
	"github.com/cubesandbox/cube/internal/serve"
	"github.com/cubesandbox/cube/internal/vmguest"
)

// Runtimes other than runc need more from a private node than runc does:
// gVisor reaches its agent only through a network slot (so network-agent
// must run) and takes memory snapshots only with [gvisor] checkpoint on;
// a VM needs the guest kernel and, under TCG, far more time to boot than
// the default agent-ready timeout allows.

// RuntimeTOML is what a private node's config needs for rt; agentSock is
// the network-agent socket ("" when none runs).
func RuntimeTOML(rt, agentSock, guestDir string) string {
	var b strings.Builder
	if agentSock != "" {
		fmt.Fprintf(&b, "[network]\nagent_socket = %q\nagent_timeout = \"60s\"\n", agentSock)
	}
	switch rt {
	case "gvisor":
		// Memory snapshots are off by default on this runsc (docs/gvisor.md);
		// warm templates, memory clones and pause to disk need them.
		b.WriteString("[gvisor]\ncheckpoint = true\n[sandbox]\nagent_ready_timeout = \"60s\"\n")
	case "vm":
		// TCG boots a kernel in seconds, more on a loaded host.
		fmt.Fprintf(&b, "[vm]\nenabled = true\nguest_dir = %q\naccel = \"auto\"\n[sandbox]\nagent_ready_timeout = \"180s\"\n", guestDir)
	}
	return b.String()
}

// GuestDir returns a directory with the VM guest artifacts: want when
// given, else the default place, else ones built into dir (the kernel
// package comes from the cache hack/vm-guest keeps).
func GuestDir(ctx context.Context, want, dir string) (string, error) {
	if want != "" {
		if _, err := vmguest.Load(want); err != nil {
			return "", fmt.Errorf("--vm-guest-dir %s: %w", want, err)
		}
		return want, nil
	}
	if _, err := vmguest.Load(vmguest.DefaultOutDir); err == nil {
		return vmguest.DefaultOutDir, nil
	}
	out := filepath.Join(dir, "vm-guest")
	if _, err := vmguest.Build(ctx, vmguest.BuildConfig{OutDir: out, CacheDir: vmguest.DefaultCacheDir}); err != nil {
		return "", fmt.Errorf("build the VM guest (or pass --vm-guest-dir): %w", err)
	}
	return out, nil
}

// NetAgent is a network-agent served in-process for a private node, on
// private directories, a random node CIDR and its own link prefix.
type NetAgent struct {
	a      *agent.Agent
	prefix string
	socket string
	dir    string
	stop   context.CancelFunc
	served chan error
}

// StartNetAgent starts it, for the node of run runID, in dir; its close purges every slot.
func StartNetAgent(ctx context.Context, runID, dir string, log *slog.Logger) (*NetAgent, error) {
	c := agent.Defaults()
	c.Prefix = "b" + runID[:min(7, len(runID))]
	c.RunDir, c.DataDir = filepath.Join(dir, "run"), filepath.Join(dir, "data")
	c.API.Socket, c.API.HTTP = filepath.Join(dir, "agent.sock"), ""
	c.Pool.Size, c.Pool.VMSize, c.Pool.RefillPerSecond = 4, 0, 50
	var (
		a   *agent.Agent
		err error
	)
	// Another process on this host may hold the CIDR picked: the agent
	// refuses an overlap, so try other blocks.
	for try := 0; try < 5; try++ {
		c.NodeCIDR = randomCIDR(20)
		if err = c.Validate(); err != nil {
			return nil, err
		}
		if a, err = agent.New(ctx, c, log); err == nil || !strings.Contains(err.Error(), "overlaps") {
			break
		}
	}
	if err != nil {
		return nil, fmt.Errorf("start network-agent: %w", err)
	}
	sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	n := &NetAgent{a: a, prefix: c.Prefix, socket: c.API.Socket, dir: dir, stop: cancel, served: make(chan error, 1)}
	go func() { n.served <- agentapi.Serve(sctx, a, log) }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if serve.Accepting(n.socket) {
			return n, nil
		}
		select {
		case err := <-n.served:
			n.served <- err
			return nil, errors.Join(fmt.Errorf("network-agent serve: %w", err), n.Close(ctx))
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return nil, errors.Join(errors.New("network-agent socket did not appear within 10s"), n.Close(ctx))
		}
	}
}

// Socket is the agent's API socket, for cubelet's [network] agent_socket.
func (n *NetAgent) Socket() string { return n.socket }

// Close stops serving and releases every slot and host rule; call it
// after cubelet has stopped (its sandboxes gave their slots back).
func (n *NetAgent) Close(ctx context.Context) error {
	ctx = context.WithoutCancel(ctx)
	n.stop()
	serr := <-n.served
	n.served <- serr
	errs := []error{n.a.Purge(ctx), n.a.Close()}
	if serr != nil && !errors.Is(serr, context.Canceled) {
		errs = append(errs, serr)
	}
	errs = append(errs, os.RemoveAll(n.dir))
	return errors.Join(errs...)
}

// Scope is what the leak checker inspects for this agent.
func (n *NetAgent) Scope() leakcheck.Scope {
	return leakcheck.Scope{NetPrefix: n.prefix, NetnsDir: filepath.Join(n.dir, "run", "netns")}
}

// randomCIDR picks a block in 10.192.0.0/10, as network tests do, so runs
// on one host rarely collide.
func randomCIDR(bits int) string {
	size := int64(1) << (32 - bits)
	v, _ := rand.Int(rand.Reader, big.NewInt((int64(1)<<22)/size))
	a := uint32(10)<<24 | uint32(192)<<16 | uint32(v.Int64()*size)
	return netip.PrefixFrom(netip.AddrFrom4([4]byte{byte(a >> 24), byte(a >> 16), byte(a >> 8), byte(a)}), bits).String()
}

// SweepRunsc deletes what a runsc root still holds (a safety net behind
// cubelet's own deletes, like Teardown's runc sweep).
func SweepRunsc(ctx context.Context, root string) {
	if _, err := os.Stat(root); err != nil {
		return
	}
	out, err := exec.CommandContext(ctx, "runsc", "--root", root, "list", "-q").Output()
	if err != nil {
		return
	}
	for _, id := range strings.Fields(string(out)) {
		_ = exec.CommandContext(ctx, "runsc", "--root", root, "delete", "--force", id).Run()
	}
}
