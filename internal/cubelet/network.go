package cubelet

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/client"
	"github.com/cubesandbox/cube/internal/network/policy"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// netAgent is cubelet's handle on network-agent, dialled on first use
// (gRPC connects lazily, so a dial never waits for the agent).
type netAgent struct {
	once sync.Once
	c    *client.Client
	err  error
}

// netClient returns the network-agent client, or nil and no error when
// none is configured.
func (n *node) netClient() (*client.Client, error) {
	sock := n.cfg.Network.AgentSocket
	if sock == "" {
		return nil, nil
	}
	n.net.once.Do(func() { n.net.c, n.net.err = client.Dial(sock) })
	return n.net.c, n.net.err
}

func (n *node) netTimeout() time.Duration {
	if d := n.cfg.Network.AgentTimeout.Duration; d > 0 {
		return d
	}
	return 10 * time.Second
}

// slotKind is the kind of slot a runtime needs: VMs attach to a TAP, every
// other runtime joins the slot's sandbox namespace.
func slotKind(runtime string) network.Kind {
	if runtime == "vm" {
		return network.VM
	}
	return network.Container
}

func policyOf(rec *sandbox.Record) policy.Policy {
	if rec.NetworkPolicy == nil {
		return policy.Policy{}
	}
	return rec.NetworkPolicy.Clone()
}

// netAction gives the sandbox its network slot (create, clone), releases
// it (destroy, cleanup) and re-applies its policy before the sandbox runs
// again (resume). Without a network-agent it does nothing.
type netAction struct{ n *node }

func (*netAction) Name() string { return "net" }

func (a *netAction) Create(ctx context.Context, t *Task) error {
	c, err := a.n.netClient()
	if c == nil {
		return err
	}
	rec := t.Record()
	kind := slotKind(rec.Runtime)
	// Recorded before the slot exists: a crash from here on leaves a
	// record that cleanup releases (Release is idempotent).
	if err := t.Update(func(r *sandbox.Record) { r.Network = &sandbox.Network{Kind: string(kind)} }); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, a.n.netTimeout())
	defer cancel()
	n, err := c.Ensure(ctx, rec.ID, kind, policyOf(rec))
	if err != nil {
		return fmt.Errorf("network slot: %w", err)
	}
	return t.Update(func(r *sandbox.Record) { r.Network = networkRecord(n) })
}

func networkRecord(n *network.Network) *sandbox.Network {
	return &sandbox.Network{
		Kind: string(n.Kind), Slot: n.Slot, HostIP: n.HostIP, GatewayIP: n.GatewayIP,
		SandboxIP: n.SandboxIP, NetNS: n.NetNS, SlotNetNS: n.SlotNetNS,
	}
}

func (a *netAction) Destroy(ctx context.Context, t *Task) error {
	rec := t.Record()
	if rec.Network == nil {
		return nil
	}
	c, err := a.n.netClient()
	if err != nil {
		return err
	}
	if c == nil {
		return fmt.Errorf("sandbox %s holds network slot %d but no network-agent is configured ([network] agent_socket): %w",
			rec.ID, rec.Network.Slot, errdefs.ErrFailedPrecondition)
	}
	ctx, cancel := context.WithTimeout(ctx, a.n.netTimeout())
	defer cancel()
	if _, err := c.Release(ctx, rec.ID); err != nil {
		return fmt.Errorf("release network slot: %w", err)
	}
	return t.Update(func(r *sandbox.Record) { r.Network = nil })
}

// Resume re-applies the sandbox's policy (and repairs its slot) before the
// container is thawed: whatever happened to the rules while it was paused,
// it runs again under its own.
func (a *netAction) Resume(ctx context.Context, t *Task) error {
	rec := t.Record()
	if rec.Network == nil {
		return nil
	}
	c, err := a.n.netClient()
	if c == nil {
		if err == nil {
			err = fmt.Errorf("sandbox %s has a network slot but no network-agent is configured: %w", rec.ID, errdefs.ErrFailedPrecondition)
		}
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, a.n.netTimeout())
	defer cancel()
	if _, err := c.UpdatePolicy(ctx, rec.ID, nil); err != nil {
		return fmt.Errorf("re-apply network policy: %w", err)
	}
	return nil
}

// checkNetworkPolicy refuses a policy the node cannot enforce: silently
// dropping a sandbox's egress restrictions would be worse than failing.
func (s *Service) checkNetworkPolicy(p *policy.Policy) error {
	if p == nil || p.IsDefault() || s.cfg.Network.AgentSocket != "" {
		return nil
	}
	return fmt.Errorf("network policy [%s] needs a network-agent, and this node has none ([network] agent_socket): %w",
		p, errdefs.ErrFailedPrecondition)
}

// UpdateNetwork replaces a running or paused sandbox's egress policy; the
// new one applies at once, to connections already open too.
func (s *Service) UpdateNetwork(ctx context.Context, id string, p policy.Policy) (*sandbox.Record, error) {
	e, err := s.lookup(id)
	if err != nil {
		return nil, err
	}
	if err := e.acquire(ctx); err != nil {
		return nil, fmt.Errorf("sandbox %s is busy: %w", id, err)
	}
	defer e.release()
	rec := e.rec.Load()
	if rec.State != lifecycle.Running && rec.State != lifecycle.Paused {
		return nil, &lifecycle.TransitionError{ID: id, From: rec.State, To: rec.State, Verb: "update network"}
	}
	if rec.Network == nil {
		return nil, fmt.Errorf("sandbox %s has no network slot (no network-agent on this node): %w", id, errdefs.ErrFailedPrecondition)
	}
	c, err := s.node.netClient()
	if err != nil {
		return nil, err
	}
	if c == nil {
		return nil, fmt.Errorf("no network-agent configured: %w", errdefs.ErrFailedPrecondition)
	}
	cctx, cancel := context.WithTimeout(ctx, s.node.netTimeout())
	defer cancel()
	if _, err := c.UpdatePolicy(cctx, id, &p); err != nil {
		return nil, err
	}
	t := newTask(s.store, e, rec, nil)
	if err := t.Update(func(r *sandbox.Record) { r.NetworkPolicy = &p }); err != nil {
		return nil, err
	}
	s.log.Info("network policy updated", "sandbox_id", id, "policy", p.String())
	return t.Record(), nil
}

// networkHealth checks network-agent; on is false when none is configured.
func (s *Service) networkHealth(ctx context.Context) (err error, on bool) {
	c, err := s.node.netClient()
	if c == nil {
		return err, err != nil
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	h, err := c.Health(ctx)
	if err != nil {
		return err, true
	}
	if !h.Ok {
		var bad []error
		for _, c := range h.Conditions {
			if !c.Ok {
				bad = append(bad, fmt.Errorf("%s: %s", c.Type, c.Message))
			}
		}
		return errors.Join(bad...), true
	}
	return nil, true
}

// sweepNetworks releases the slots network-agent holds for sandboxes this
// cubelet has no record of (a create whose record was lost with a crash
// before the slot was recorded cannot happen, the record goes first; a
// replaced state file can). One cubelet owns a node's network-agent.
func (s *Service) sweepNetworks(ctx context.Context, known map[string]bool, sum *reconcileSummary) {
	c, err := s.node.netClient()
	if c == nil {
		if err != nil {
			sum.Errors = append(sum.Errors, "network-agent: "+err.Error())
		}
		return
	}
	ctx, cancel := context.WithTimeout(ctx, s.node.netTimeout())
	defer cancel()
	nets, err := c.List(ctx)
	if err != nil {
		sum.Errors = append(sum.Errors, "list network slots: "+err.Error())
		return
	}
	for _, n := range nets {
		if known[n.SandboxID] {
			continue
		}
		if _, err := c.Release(ctx, n.SandboxID); err != nil {
			sum.Errors = append(sum.Errors, fmt.Sprintf("release orphan slot of %s: %v", n.SandboxID, err))
			continue
		}
		sum.Orphan++
	}
}

// WaitAgentVia polls the agent's /health through the sandbox's host IP
// (its slot DNATs every port there to the sandbox) until it answers, the
// sandbox's init (pid) dies, or ctx ends. This is the path the proxy
// uses, so a sandbox is Running only when it is reachable that way.
func WaitAgentVia(ctx context.Context, pid int, hostIP string) error {
	client := hostIPClient()
	url := "http://" + net.JoinHostPort(hostIP, strconv.Itoa(agentproto.Port)) + "/health"
	return pollHealth(ctx, client, url, pid)
}
