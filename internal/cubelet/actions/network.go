package actions

import (
	"context"
	"fmt"

	"github.com/cubesandbox/cube/internal/cubelet/netagent"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// netAction gives the sandbox its network slot (create, clone), releases
// it (destroy, cleanup) and re-applies its policy before the sandbox runs
// again (resume, resume_disk). Without a network-agent it does nothing.
type netAction struct{ n *Node }

func (*netAction) Name() string { return "net" }

func (a *netAction) Create(ctx context.Context, t *Task) error {
	c, err := a.n.Net.Client()
	if c == nil {
		return err
	}
	rec := t.Record()
	d, err := a.n.Driver(rec.Runtime)
	if err != nil {
		return err
	}
	kind := netagent.SlotKind(d.Capabilities())
	// Recorded before the slot exists: a crash from here on leaves a
	// record that cleanup releases (Release is idempotent).
	if err := t.Update(func(r *sandbox.Record) { r.Network = &sandbox.Network{Kind: string(kind)} }); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, a.n.Net.Timeout())
	defer cancel()
	n, err := c.Ensure(ctx, rec.HostKey(), kind, netagent.PolicyOf(rec))
	if err != nil {
		return fmt.Errorf("network slot: %w", err)
	}
	return t.Update(func(r *sandbox.Record) { r.Network = netagent.Record(n) })
}

func (a *netAction) Destroy(ctx context.Context, t *Task) error {
	rec := t.Record()
	if rec.Network == nil {
		return nil
	}
	c, err := a.n.Net.Client()
	if err != nil {
		return err
	}
	if c == nil {
		return fmt.Errorf("sandbox %s holds network slot %d but no network-agent is configured ([network] agent_socket): %w",
			rec.ID, rec.Network.Slot, errdefs.ErrFailedPrecondition)
	}
	ctx, cancel := context.WithTimeout(ctx, a.n.Net.Timeout())
	defer cancel()
	if _, err := c.Release(ctx, rec.HostKey()); err != nil {
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
	c, err := a.n.Net.Client()
	if c == nil {
		if err == nil {
			err = fmt.Errorf("sandbox %s has a network slot but no network-agent is configured: %w", rec.ID, errdefs.ErrFailedPrecondition)
		}
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, a.n.Net.Timeout())
	defer cancel()
	if _, err := c.UpdatePolicy(ctx, rec.HostKey(), nil); err != nil {
		return fmt.Errorf("re-apply network policy: %w", err)
	}
	return nil
}
