package cubelet

import (
	"context"
	"fmt"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/network/policy"
	"github.com/cubesandbox/cube/internal/sandbox"
)

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
	if err := s.node.Net.UpdatePolicy(ctx, rec.HostKey(), &p); err != nil {
		return nil, err
	}
	t := newTask(s.store, e, rec, nil)
	if err := t.Update(func(r *sandbox.Record) { r.NetworkPolicy = &p }); err != nil {
		return nil, err
	}
	s.log.Info("network policy updated", "sandbox_id", id, "policy", p.String())
	return t.Record(), nil
}

// runtimeUsable refuses, before anything is created, a sandbox its
// runtime could start but cubelet could never reach: a runtime that needs
// a network slot (Capabilities.NeedsSlot: gVisor runs its own network
// stack, so its agent answers only at a slot's address) on a node without
// network-agent.
func (s *Service) runtimeUsable(name string) error {
	d, err := s.node.Driver(name)
	if err != nil {
		return err
	}
	if d.Capabilities().NeedsSlot && !s.node.Net.Configured() {
		return fmt.Errorf("runtime %s needs network slots (network.agent_socket): its agent is reachable only through one: %w",
			name, errdefs.ErrFailedPrecondition)
	}
	return nil
}
