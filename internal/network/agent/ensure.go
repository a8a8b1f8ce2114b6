package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"sort"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/nft"
	"github.com/cubesandbox/cube/internal/network/policy"
	"github.com/cubesandbox/cube/internal/network/slot"
	"github.com/cubesandbox/cube/internal/network/slotstore"
	"github.com/cubesandbox/cube/internal/sandboxid"
)

// EnsureRequest asks for a sandbox's slot.
type EnsureRequest struct {
	SandboxID string
	Kind      network.Kind
	Policy    policy.Policy
}

// Ensure gives the sandbox a slot with the request's policy applied: a
// pooled slot when one is ready, else a new one. It is idempotent by
// sandbox ID: a repeat with the same kind and policy returns the slot the
// sandbox has (created = false); a different kind or policy is
// errdefs.ErrAlreadyExists (change a policy with UpdatePolicy).
//
// A failed Ensure leaves nothing: the slot it took or made is released.
func (a *Agent) Ensure(ctx context.Context, req EnsureRequest) (n *network.Network, created bool, err error) {
	if err := sandboxid.Validate("sandbox", req.SandboxID); err != nil {
		return nil, false, err
	}
	kind, err := network.ParseKind(string(req.Kind))
	if err != nil {
		return nil, false, err
	}
	if err := a.checkPolicy(req.Policy); err != nil {
		return nil, false, err
	}
	a.opMu.RLock()
	defer a.opMu.RUnlock()
	unlock := a.locks.lock(req.SandboxID)
	defer unlock()
	start := time.Now()
	source := "existing"
	defer func() { a.metrics.observeEnsure(source, start, err) }()

	a.mu.Lock()
	if i, ok := a.bySandbox[req.SandboxID]; ok {
		r := a.slots[i].Clone()
		a.mu.Unlock()
		if r.State != slotstore.Assigned {
			// A release that failed half-way: finish it first.
			return nil, false, fmt.Errorf("slot %d of sandbox %s is %s: release it again first: %w",
				i, req.SandboxID, r.State, errdefs.ErrFailedPrecondition)
		}
		if r.Kind != kind || !r.Policy.Equal(req.Policy) {
			return nil, false, fmt.Errorf("sandbox %s already has a %s slot with policy [%s], not a %s slot with [%s] (use UpdatePolicy to change a policy): %w",
				req.SandboxID, r.Kind, r.Policy, kind, req.Policy, errdefs.ErrAlreadyExists)
		}
		if err := a.attachDNS(r, false); err != nil {
			return nil, false, err
		}
		return a.view(r), false, nil
	}
	i, pooled := a.popPool(kind)
	a.mu.Unlock()
	a.kickFill()

	var r *slotstore.Record
	if pooled {
		source = "pool"
		r, err = a.assignPooled(ctx, i, req.SandboxID, req.Policy)
		if err != nil && ctx.Err() == nil {
			// A broken pooled slot (released by assignPooled) must not fail
			// the sandbox: build one instead.
			a.metrics.errors.WithLabelValues("assign_pooled").Inc()
			a.log.Warn("pooled slot unusable; creating one", "slot", i, "sandbox_id", req.SandboxID, "err", err)
			pooled = false
		}
	}
	if !pooled {
		source = "cold"
		r, err = a.createFor(ctx, kind, req.SandboxID, req.Policy)
	}
	if err == nil {
		// A sandbox without its resolver is refused rather than started
		// half-networked.
		if err = a.attachDNS(r, true); err != nil {
			err = errors.Join(err, a.releaseSlot(context.WithoutCancel(ctx), r.Index))
		}
	}
	if err != nil {
		return nil, false, err
	}
	a.log.Debug("slot assigned", "sandbox_id", req.SandboxID, "slot", r.Index, "from_pool", pooled, "duration", time.Since(start))
	return a.view(r), true, nil
}

// popPool takes the oldest ready slot of kind. Caller holds a.mu.
func (a *Agent) popPool(kind network.Kind) (int, bool) {
	q := a.pool[kind]
	if len(q) == 0 {
		return 0, false
	}
	a.pool[kind] = q[1:]
	return q[0], true
}

// assignPooled gives ready slot i to a sandbox: the record first, then the
// policy (the slot held deny-all until now, so it leaks nothing in between).
func (a *Agent) assignPooled(ctx context.Context, i int, id string, p policy.Policy) (*slotstore.Record, error) {
	a.mu.Lock()
	r := a.slots[i].Clone()
	a.mu.Unlock()
	r.State, r.SandboxID, r.Policy, r.FromPool, r.AssignedAt = slotstore.Assigned, id, p.Clone(), true, time.Now().UTC()
	if err := a.put(r); err != nil {
		return nil, errors.Join(err, a.releaseSlot(context.WithoutCancel(ctx), i))
	}
	err := failpoint.Eval(ctx, "network/assign/policy")
	if err == nil {
		err = a.applyPolicy(r, poolPolicy)
	}
	if err != nil {
		return nil, errors.Join(fmt.Errorf("apply policy to slot %d: %w", i, err), a.releaseSlot(context.WithoutCancel(ctx), i))
	}
	return r, nil
}

// createFor makes a new slot for a sandbox (the pool was empty).
func (a *Agent) createFor(ctx context.Context, kind network.Kind, id string, p policy.Policy) (*slotstore.Record, error) {
	r, err := a.newSlot(ctx, kind, id, p)
	if err != nil {
		return nil, err
	}
	r.State, r.AssignedAt = slotstore.Assigned, time.Now().UTC()
	if err := a.put(r); err != nil {
		return nil, errors.Join(err, a.releaseSlot(context.WithoutCancel(ctx), r.Index))
	}
	return r, nil
}

// newSlot allocates a slot number, records it as Creating, and builds it.
// On failure everything is released again.
func (a *Agent) newSlot(ctx context.Context, kind network.Kind, id string, p policy.Policy) (*slotstore.Record, error) {
	i, err := a.space.Allocate()
	if err != nil {
		return nil, err
	}
	r := &slotstore.Record{Index: i, Kind: kind, State: slotstore.Creating, SandboxID: id, Policy: p.Clone(), CreatedAt: time.Now().UTC()}
	if err := a.put(r); err != nil {
		a.space.Free(i)
		return nil, err
	}
	if err := failpoint.Eval(ctx, "network/create/after-record"); err != nil {
		return nil, errors.Join(err, a.releaseSlot(context.WithoutCancel(ctx), i))
	}
	if _, err := slot.Converge(ctx, a.layout(i, kind), p); err != nil {
		return nil, errors.Join(err, a.releaseSlot(context.WithoutCancel(ctx), i))
	}
	return r, nil
}

// put persists r and mirrors it in the maps.
func (a *Agent) put(r *slotstore.Record) error {
	if err := a.store.Put(r); err != nil {
		return fmt.Errorf("persist slot %d: %w", r.Index, err)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	a.slots[r.Index] = r.Clone()
	if r.SandboxID != "" {
		a.bySandbox[r.SandboxID] = r.Index
	}
	return nil
}

// releaseSlot tears slot i down: Releasing is recorded first, the record
// goes last, so a crash in between is finished by reconcile. A failure
// leaves the record (still Releasing) for a retry.
func (a *Agent) releaseSlot(ctx context.Context, i int) error {
	a.mu.Lock()
	cur := a.slots[i]
	a.mu.Unlock()
	if cur == nil {
		return nil
	}
	r := cur.Clone()
	if r.State != slotstore.Releasing {
		r.State = slotstore.Releasing
		if err := a.put(r); err != nil {
			return err
		}
	}
	a.detachDNS(r.SandboxID)
	if err := failpoint.Eval(ctx, "network/release/after-record"); err != nil {
		return err
	}
	if err := slot.Release(ctx, a.layout(i, r.Kind)); err != nil {
		return err
	}
	if err := a.store.Delete(i); err != nil {
		return fmt.Errorf("forget slot %d: %w", i, err)
	}
	a.mu.Lock()
	delete(a.slots, i)
	if r.SandboxID != "" && a.bySandbox[r.SandboxID] == i {
		delete(a.bySandbox, r.SandboxID)
	}
	a.removeFromPool(i)
	a.mu.Unlock()
	a.space.Free(i)
	return nil
}

func (a *Agent) removeFromPool(i int) {
	for k, q := range a.pool {
		for j, x := range q {
			if x == i {
				a.pool[k] = append(q[:j:j], q[j+1:]...)
				return
			}
		}
	}
}

// Release destroys a sandbox's slot. A sandbox without one is not an
// error (released = false): destroy flows retry blindly.
func (a *Agent) Release(ctx context.Context, sandboxID string) (released bool, err error) {
	if err := sandboxid.Validate("sandbox", sandboxID); err != nil {
		return false, err
	}
	a.opMu.RLock()
	defer a.opMu.RUnlock()
	unlock := a.locks.lock(sandboxID)
	defer unlock()
	a.mu.Lock()
	i, ok := a.bySandbox[sandboxID]
	a.mu.Unlock()
	if !ok {
		return false, nil
	}
	start := time.Now()
	err = a.releaseSlot(ctx, i)
	a.metrics.observe("release", start, err)
	if err != nil {
		return false, err
	}
	a.kickFill()
	return true, nil
}

// Get returns a sandbox's slot.
func (a *Agent) Get(_ context.Context, sandboxID string) (*network.Network, error) {
	if err := sandboxid.Validate("sandbox", sandboxID); err != nil {
		return nil, err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	i, ok := a.bySandbox[sandboxID]
	if !ok {
		return nil, fmt.Errorf("sandbox %s has no network slot: %w", sandboxID, errdefs.ErrNotFound)
	}
	return a.view(a.slots[i]), nil
}

// List returns every assigned slot, by slot number.
func (a *Agent) List(context.Context) []*network.Network {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make([]*network.Network, 0, len(a.bySandbox))
	for _, i := range a.bySandbox {
		out = append(out, a.view(a.slots[i]))
	}
	sort.Slice(out, func(x, y int) bool { return out[x].Slot < out[y].Slot })
	return out
}

// UpdatePolicy replaces a sandbox's policy in one nftables transaction and
// forgets the connections the sandbox opened, so that the new policy
// decides for connections already open too (an allowed one is picked up
// again on its next packet; a denied one stops). With p == nil it
// re-applies the stored policy and repairs whatever is missing from the
// slot: what resume and restore call before the sandbox runs again.
func (a *Agent) UpdatePolicy(ctx context.Context, sandboxID string, p *policy.Policy) (*network.Network, error) {
	if err := sandboxid.Validate("sandbox", sandboxID); err != nil {
		return nil, err
	}
	if p != nil {
		if err := a.checkPolicy(*p); err != nil {
			return nil, err
		}
	}
	a.opMu.RLock()
	defer a.opMu.RUnlock()
	unlock := a.locks.lock(sandboxID)
	defer unlock()
	start := time.Now()
	a.mu.Lock()
	i, ok := a.bySandbox[sandboxID]
	var r *slotstore.Record
	if ok {
		r = a.slots[i].Clone()
	}
	a.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("sandbox %s has no network slot: %w", sandboxID, errdefs.ErrNotFound)
	}
	if r.State != slotstore.Assigned {
		return nil, fmt.Errorf("slot %d of sandbox %s is %s: %w", i, sandboxID, r.State, errdefs.ErrFailedPrecondition)
	}
	if p == nil {
		made, err := slot.Converge(ctx, a.layout(i, r.Kind), r.Policy)
		a.metrics.observe("reapply", start, err)
		if err != nil {
			return nil, err
		}
		if len(made) > 0 {
			a.log.Warn("slot repaired on re-apply", "sandbox_id", sandboxID, "slot", i, "recreated", made)
		}
		if err := a.attachDNS(r, slices.Contains(made, "netns")); err != nil {
			return nil, err
		}
		return a.view(r), nil
	}
	old := r.Policy
	r.Policy = p.Clone()
	err := a.applyPolicy(r, old)
	if err == nil {
		if err = a.put(r); err != nil {
			r.Policy = old
			err = errors.Join(err, a.applyPolicy(r, *p))
		}
	}
	if err == nil {
		// Before the conntrack flush: addresses of names no longer
		// allowed leave the resolved set first, so the connections cut
		// below cannot come back through them.
		err = a.attachDNS(r, false)
	}
	if err == nil {
		err = a.forgetConnections(r)
	}
	a.metrics.observe("update_policy", start, err)
	if err != nil {
		return nil, err
	}
	a.log.Info("policy updated", "sandbox_id", sandboxID, "slot", i, "policy", p.String())
	return a.view(r), nil
}

// applyPolicy moves slot r's rules from policy prev to r.Policy.
func (a *Agent) applyPolicy(r *slotstore.Record, prev policy.Policy) error {
	l := a.layout(r.Index, r.Kind)
	f, err := os.Open(l.SlotNS())
	if err != nil {
		return fmt.Errorf("slot %d: %w", r.Index, err)
	}
	defer f.Close()
	return nft.UpdateSlotPolicy(int(f.Fd()), l.Rules(r.Policy), prev)
}

// forgetConnections deletes the slot's conntrack entries of connections
// the sandbox opened (original source = the sandbox address), so that
// their next packets meet the new policy. Connections the host opened to
// the sandbox (the proxy) are left alone.
func (a *Agent) forgetConnections(r *slotstore.Record) error {
	ns, err := netns.GetFromPath(a.layout(r.Index, r.Kind).SlotNS())
	if err != nil {
		return err
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns, unix.NETLINK_NETFILTER)
	if err != nil {
		return err
	}
	defer h.Close()
	f := &netlink.ConntrackFilter{}
	if err := f.AddIP(netlink.ConntrackOrigSrcIP, net.IP(network.SandboxIP.AsSlice())); err != nil {
		return err
	}
	if _, err := h.ConntrackDeleteFilters(netlink.ConntrackTable, unix.AF_INET, f); err != nil {
		return fmt.Errorf("slot %d: flush conntrack: %w", r.Index, err)
	}
	return nil
}

// checkPolicy refuses what this node cannot enforce: private ranges it
// does not open, and credential or request rules without the egress proxy (a policy
// that cannot be enforced is refused, not dropped).
func (a *Agent) checkPolicy(p policy.Policy) error {
	if err := policy.CheckOpened("policy", p, a.cfg.Opened()); err != nil {
		return err
	}
	if len(p.Credentials) > 0 && a.egress == nil {
		return fmt.Errorf("policy.credentials: this node runs no egress proxy ([egress] enabled = false): %w", errdefs.ErrFailedPrecondition)
	}
	if len(p.Requests) > 0 && a.egress == nil {
		return fmt.Errorf("policy.requests: this node runs no egress proxy ([egress] enabled = false): %w", errdefs.ErrFailedPrecondition)
	}
	return nil
}
