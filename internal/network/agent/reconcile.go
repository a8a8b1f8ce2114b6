package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"

	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/ipam"
	"github.com/cubesandbox/cube/internal/network/netnsdir"
	"github.com/cubesandbox/cube/internal/network/nft"
	"github.com/cubesandbox/cube/internal/network/nl"
	"github.com/cubesandbox/cube/internal/network/policy"
	"github.com/cubesandbox/cube/internal/network/slot"
	"github.com/cubesandbox/cube/internal/network/slotstore"
)

// Summary is what a reconcile did.
type Summary struct {
	Adopted  int // slots found intact
	Repaired int // slots whose missing pieces were recreated
	Released int // half-made or broken slots torn down
	Orphans  int // kernel objects no record named, removed
	Errors   []string
}

func errorsJoin(errs ...error) error { return errors.Join(errs...) }

// Reconcile compares the store with the kernel and makes them agree, while
// no other operation runs.
func (a *Agent) Reconcile(ctx context.Context) (Summary, error) {
	a.opMu.Lock()
	defer a.opMu.Unlock()
	return a.reconcile(ctx)
}

// reconcile, per slot record:
//   - Creating or Releasing (the agent died mid-way): release it. The
//     caller's Ensure failed with the crash and will be retried or undone.
//   - Ready: converge it with the deny-all policy and put it back in the
//     pool; release it if that fails.
//   - Assigned: converge it with its policy (recreating what is missing:
//     adopted or repaired); on failure keep the record and report it.
//
// Then every namespace pin and host link with the agent's prefix that no
// record names is removed, and the host table is re-applied.
func (a *Agent) reconcile(ctx context.Context) (Summary, error) {
	var sum Summary
	recs, err := a.store.List()
	if err != nil {
		return sum, err
	}
	space, err := ipam.New(a.cfg.CIDR())
	if err != nil {
		return sum, err
	}
	a.mu.Lock()
	a.space = space
	a.slots, a.bySandbox, a.pool = map[int]*slotstore.Record{}, map[string]int{}, map[network.Kind][]int{}
	a.mu.Unlock()
	for _, r := range recs {
		if err := space.Reserve(r.Index); err != nil {
			sum.Errors = append(sum.Errors, fmt.Sprintf("slot %d: %v", r.Index, err))
			continue
		}
		a.mu.Lock()
		a.slots[r.Index] = r.Clone()
		if r.SandboxID != "" {
			a.bySandbox[r.SandboxID] = r.Index
		}
		a.mu.Unlock()
	}
	for _, r := range recs {
		a.reconcileSlot(ctx, r, &sum)
	}
	a.sweepOrphans(&sum)
	if err := nft.ApplyHost(nft.Host{Table: a.cfg.Prefix, LinkPrefix: a.linkPrefix(), NodeCIDR: a.cfg.CIDR()}); err != nil {
		sum.Errors = append(sum.Errors, err.Error())
	}
	a.metrics.reconciled(sum)
	return sum, nil
}

func (a *Agent) reconcileSlot(ctx context.Context, r *slotstore.Record, sum *Summary) {
	fail := func(err error) {
		sum.Errors = append(sum.Errors, fmt.Sprintf("slot %d (%s): %v", r.Index, r.SandboxID, err))
	}
	switch r.State {
	case slotstore.Creating, slotstore.Releasing:
		if err := a.releaseSlot(ctx, r.Index); err != nil {
			fail(err)
			return
		}
		sum.Released++
	case slotstore.Ready:
		made, err := slot.Converge(ctx, a.layout(r.Index, r.Kind), poolPolicy)
		if err != nil {
			if rerr := a.releaseSlot(ctx, r.Index); rerr != nil {
				fail(errors.Join(err, rerr))
				return
			}
			sum.Released++
			return
		}
		count(sum, made)
		a.mu.Lock()
		a.pool[r.Kind] = append(a.pool[r.Kind], r.Index)
		a.mu.Unlock()
	case slotstore.Assigned:
		if err := policy.CheckOpened("policy", r.Policy, a.cfg.Opened()); err != nil {
			// Stored before the range was closed: the slot is repaired,
			// and the entry reaches nothing.
			a.log.Warn("stored policy names private addresses this node keeps closed; they stay unreachable",
				"sandbox_id", r.SandboxID, "error", err)
		}
		made, err := slot.Converge(ctx, a.layout(r.Index, r.Kind), r.Policy)
		if err != nil {
			fail(err)
			return
		}
		if len(made) > 0 {
			a.log.Warn("slot repaired", "sandbox_id", r.SandboxID, "slot", r.Index, "recreated", made)
		}
		if err := a.attachDNS(r, slices.Contains(made, "netns")); err != nil {
			fail(err)
			return
		}
		count(sum, made)
	default:
		fail(fmt.Errorf("unknown state %q", r.State))
	}
}

func count(sum *Summary, made []string) {
	if len(made) == 0 {
		sum.Adopted++
	} else {
		sum.Repaired++
	}
}

// sweepOrphans removes pins and host links of this agent that no record
// names. A crash cannot leave them (records are written first and deleted
// last), but a lost or replaced state file can.
func (a *Agent) sweepOrphans(sum *Summary) {
	a.mu.Lock()
	known := map[int]network.Kind{}
	for i, r := range a.slots {
		known[i] = r.Kind
	}
	a.mu.Unlock()
	dir := a.cfg.NetnsDir()
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		name := e.Name()
		base, sb := strings.CutSuffix(name, "-sb")
		i, ok := a.slotOfLink(base)
		if !ok {
			continue
		}
		if kind, has := known[i]; has && (!sb || kind == network.Container) {
			continue
		}
		if err := netnsdir.Remove(dir + "/" + name); err != nil {
			sum.Errors = append(sum.Errors, err.Error())
			continue
		}
		sum.Orphans++
	}
	links, err := nl.Dump(netlink.LinkList)
	if err != nil {
		sum.Errors = append(sum.Errors, err.Error())
		return
	}
	for _, l := range links {
		i, ok := a.slotOfLink(l.Attrs().Name)
		if !ok {
			continue
		}
		if _, has := known[i]; has {
			continue
		}
		if err := netlink.LinkDel(l); err != nil {
			sum.Errors = append(sum.Errors, "delete orphan link "+l.Attrs().Name+": "+err.Error())
			continue
		}
		sum.Orphans++
	}
}
