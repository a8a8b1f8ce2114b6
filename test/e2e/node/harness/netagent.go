package main

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/leakcheck"
	"github.com/cubesandbox/cube/internal/network/agent"
	"github.com/cubesandbox/cube/internal/network/agentapi"
	"github.com/cubesandbox/cube/internal/serve"
)

// netAgent is an in-process network-agent on private directories, a
// private link prefix and a random node CIDR, as nettest runs one for
// tests (nettest needs a testing.TB; the harness is a program). A VM's
// envd path is its slot: host IP:49983 DNATs through the slot's TAP.
type netAgent struct {
	dir    string
	cfg    *agent.Config
	agent  *agent.Agent
	stop   context.CancelFunc
	served chan struct{}
}

// startNetAgent starts the agent and serves its gRPC API on a socket of
// its own; a failure leaves nothing behind.
func startNetAgent(ctx context.Context, runtime string, log *slog.Logger) (_ *netAgent, err error) {
	id := randHex(2)
	dir := filepath.Join(os.TempDir(), "cube-e2e-net-"+id)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	c := agent.Defaults()
	c.Prefix = "ne" + id
	c.RunDir = filepath.Join(dir, "run")
	c.DataDir = filepath.Join(dir, "data")
	c.API.Socket = filepath.Join(dir, "agent.sock")
	c.API.HTTP = ""
	// One slot of the sandbox's kind made ahead.
	c.Pool.Size, c.Pool.VMSize, c.Pool.RefillPerSecond = 1, 0, 200
	if runtime == "vm" {
		c.Pool.Size, c.Pool.VMSize = 0, 1
	}
	n := &netAgent{dir: dir, cfg: c}
	defer func() {
		if err != nil {
			_ = n.close(context.Background())
		}
	}()
	for try := 0; try < 5; try++ {
		c.NodeCIDR = randomCIDR(24)
		if err = c.Validate(); err != nil {
			return nil, fmt.Errorf("network-agent config: %w", err)
		}
		n.agent, err = agent.New(ctx, c, log.With("component", "network-agent"))
		// Another test process may hold the block: pick another.
		if err == nil || !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "overlaps") {
			break
		}
	}
	if err != nil {
		return nil, fmt.Errorf("start network-agent: %w", err)
	}
	sctx, cancel := context.WithCancel(context.Background())
	n.stop, n.served = cancel, make(chan struct{})
	go func() {
		defer close(n.served)
		_ = agentapi.Serve(sctx, n.agent, log.With("component", "network-agent"))
	}()
	for deadline := time.Now().Add(5 * time.Second); ; {
		if serve.Accepting(c.API.Socket) {
			return n, nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("network-agent: no socket %s after 5s: %w", c.API.Socket, errdefs.ErrUnavailable)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// randomCIDR picks a block in 10.192.0.0/10 so concurrent runs (and the
// package tests' agents) rarely collide; the agent refuses an overlap.
func randomCIDR(bits int) string {
	size := int64(1) << (32 - bits)
	v, _ := rand.Int(rand.Reader, big.NewInt((int64(1)<<22)/size))
	a := uint32(10)<<24 | uint32(192)<<16 | uint32(v.Int64()*size)
	return netip.PrefixFrom(netip.AddrFrom4([4]byte{byte(a >> 24), byte(a >> 16), byte(a >> 8), byte(a)}), bits).String()
}

// close reports slots cubelet did not release (a sandbox delete that
// leaked its network), then purges every slot, stops the agent, checks
// that no namespace, link or rule of it is left and removes its dirs.
func (n *netAgent) close(ctx context.Context) error {
	var errs []error
	if n.stop != nil {
		n.stop()
		<-n.served
	}
	if n.agent != nil {
		if left := n.agent.List(ctx); len(left) > 0 {
			var ids []string
			for _, s := range left {
				ids = append(ids, s.SandboxID)
			}
			errs = append(errs, fmt.Errorf("network-agent: slots still assigned after the sandboxes were deleted: %v", ids))
		}
		if err := n.agent.Purge(ctx); err != nil {
			errs = append(errs, fmt.Errorf("network-agent purge: %w", err))
		}
		if err := n.agent.Close(); err != nil {
			errs = append(errs, fmt.Errorf("network-agent close: %w", err))
		}
	}
	scope := leakcheck.Scope{RunDir: n.cfg.RunDir, DataDir: n.cfg.DataDir, NetPrefix: n.cfg.Prefix, NetnsDir: n.cfg.NetnsDir()}
	leaks, err := leakcheck.Check(ctx, scope)
	if err != nil {
		errs = append(errs, fmt.Errorf("network leak check: %w", err))
	}
	for _, l := range leaks {
		errs = append(errs, fmt.Errorf("leaked %s", l))
	}
	_ = os.RemoveAll(n.dir)
	return errors.Join(errs...)
}
