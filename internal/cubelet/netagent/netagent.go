// Package netagent is cubelet's handle on the node's network-agent: the
// lazily dialled gRPC client and the calls cubelet makes through it
// (slots, policies, health, the orphan sweep).
package netagent

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	networkpb "github.com/cubesandbox/cube/api/network/v1"
	"github.com/cubesandbox/cube/internal/cubelet/config"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/client"
	"github.com/cubesandbox/cube/internal/network/policy"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// Agent is network-agent as cubelet uses it, dialled on first use (gRPC
// connects lazily, so a dial never waits for the agent). Without a
// configured socket every call is a no-op or a FailedPrecondition.
type Agent struct {
	cfg  config.NetworkConfig
	once sync.Once
	c    *client.Client
	err  error
}

// New returns the handle for [network]; nothing is dialled yet.
func New(c config.NetworkConfig) *Agent { return &Agent{cfg: c} }

// Configured reports whether the node has a network-agent.
func (a *Agent) Configured() bool { return a.cfg.AgentSocket != "" }

// Client returns the network-agent client, or nil and no error when none
// is configured.
func (a *Agent) Client() (*client.Client, error) {
	if !a.Configured() {
		return nil, nil
	}
	a.once.Do(func() { a.c, a.err = client.Dial(a.cfg.AgentSocket) })
	return a.c, a.err
}

// Timeout bounds each call to network-agent.
func (a *Agent) Timeout() time.Duration {
	if d := a.cfg.AgentTimeout.Duration; d > 0 {
		return d
	}
	return 10 * time.Second
}

// SlotKind is the kind of slot a runtime needs: a TAP where the driver
// says so (Capabilities.SlotTAP: VMs), the slot's sandbox namespace
// otherwise.
func SlotKind(c runtime.Capabilities) network.Kind {
	if c.SlotTAP {
		return network.VM
	}
	return network.Container
}

// PolicyOf is the sandbox's egress policy (the default when it has none).
func PolicyOf(rec *sandbox.Record) policy.Policy {
	if rec.NetworkPolicy == nil {
		return policy.Policy{}
	}
	return rec.NetworkPolicy.Clone()
}

// Record is what the sandbox record keeps of a slot.
func Record(n *network.Network) *sandbox.Network {
	return &sandbox.Network{
		Kind: string(n.Kind), Slot: n.Slot, HostIP: n.HostIP, GatewayIP: n.GatewayIP,
		SandboxIP: n.SandboxIP, NetNS: n.NetNS, SlotNetNS: n.SlotNetNS, Resolver: n.Resolver,
		EgressCA: n.EgressCA,
	}
}

// CheckPolicy refuses a policy the node cannot enforce: silently dropping
// a sandbox's egress restrictions would be worse than failing.
func (a *Agent) CheckPolicy(p *policy.Policy) error {
	if p == nil || p.IsDefault() || a.Configured() {
		return nil
	}
	return fmt.Errorf("network policy [%s] needs a network-agent, and this node has none ([network] agent_socket): %w",
		p, errdefs.ErrFailedPrecondition)
}

// UpdatePolicy replaces a slot's policy (nil re-applies the one it has and
// repairs the slot).
func (a *Agent) UpdatePolicy(ctx context.Context, id string, p *policy.Policy) error {
	c, err := a.Client()
	if err != nil {
		return err
	}
	if c == nil {
		return fmt.Errorf("no network-agent configured: %w", errdefs.ErrFailedPrecondition)
	}
	ctx, cancel := context.WithTimeout(ctx, a.Timeout())
	defer cancel()
	_, err = c.UpdatePolicy(ctx, id, p)
	return err
}

// TakeEgressVerdicts returns network-agent's notable egress verdicts
// since the last call (nil without an agent).
func (a *Agent) TakeEgressVerdicts(ctx context.Context) (*networkpb.TakeEgressVerdictsResponse, error) {
	c, err := a.Client()
	if c == nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	return c.TakeEgressVerdicts(ctx)
}

// Health checks network-agent; on is false when none is configured.
func (a *Agent) Health(ctx context.Context) (on bool, err error) {
	c, err := a.Client()
	if c == nil {
		return err != nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	h, err := c.Health(ctx)
	if err != nil {
		return true, err
	}
	if !h.Ok {
		var bad []error
		for _, c := range h.Conditions {
			if !c.Ok {
				bad = append(bad, fmt.Errorf("%s: %s", c.Type, c.Message))
			}
		}
		return true, errors.Join(bad...)
	}
	return true, nil
}

// SweepOrphans releases the slots network-agent holds for sandboxes not in
// known (a create whose record was lost with a crash before the slot was
// recorded cannot happen, the record goes first; a replaced state file
// can). One cubelet owns a node's network-agent. It returns how many slots
// it released and what went wrong.
func (a *Agent) SweepOrphans(ctx context.Context, known map[string]bool) (released int, errs []string) {
	c, err := a.Client()
	if c == nil {
		if err != nil {
			errs = append(errs, "network-agent: "+err.Error())
		}
		return 0, errs
	}
	ctx, cancel := context.WithTimeout(ctx, a.Timeout())
	defer cancel()
	nets, err := c.List(ctx)
	if err != nil {
		return 0, append(errs, "list network slots: "+err.Error())
	}
	for _, n := range nets {
		if known[n.SandboxID] {
			continue
		}
		if _, err := c.Release(ctx, n.SandboxID); err != nil {
			errs = append(errs, fmt.Sprintf("release orphan slot of %s: %v", n.SandboxID, err))
			continue
		}
		released++
	}
	return released, errs
}
