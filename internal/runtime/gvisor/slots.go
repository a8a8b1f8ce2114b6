package gvisor

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	gorunc "github.com/containerd/go-runc"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// A sandbox lives under one of two runsc IDs, its slots: the sandbox ID
// plus "." (slot A, where every sandbox starts) or plus "+." (slot B).
// A restore in place (restoreSwap) starts the restored copy in the slot
// the checkpointed sandbox does not hold, so it need not wait for runsc
// to delete the old one: that is done in the background afterwards.
//
// Why two IDs and not one: runsc refuses a second container under an ID
// its root still holds, and the sandbox's control socket is an abstract
// unix socket named after the ID (@runsc-sandbox.<id>), held until the old
// sandbox process has exited. Why these two: this runsc resolves an ID it
// does not find by prefix, so no runsc ID may be the prefix of another
// (slot A of "sb-1" is "sb-1.", never a prefix of "sb-10." or of "sb-1+.");
// sandbox IDs are [a-z0-9-] (sandboxid), so neither "." nor "+" occurs in
// one, and runsc accepts both ([\w+\-.]).
//
// Which slot is current needs no record: the live one (running, paused or
// created) when only one is; else the one created last. The other, when
// present, is retired: its processes were killed and its state file says
// stopped, with no PIDs and no cgroup (retireState), so runsc's delete of
// it touches nothing the current slot uses. It is reaped in the
// background after a swap, by Stop and by the next swap synchronously,
// and by ReapRetired (cubelet's reconcile at start) after a crash.

// slotIDs are the two runsc IDs of sandbox id.
func slotIDs(id string) [2]string { return [2]string{id + ".", id + "+."} }

// otherSlot is the slot of the same sandbox that rid is not.
func otherSlot(id, rid string) string {
	s := slotIDs(id)
	if rid == s[0] {
		return s[1]
	}
	return s[0]
}

// sandboxOfSlot is the sandbox ID a runsc ID belongs to.
func sandboxOfSlot(rid string) string {
	if s, ok := strings.CutSuffix(rid, "+."); ok {
		return s
	}
	return strings.TrimSuffix(rid, ".")
}

func live(c *gorunc.Container) bool {
	return c.Status == "running" || c.Status == "paused" || c.Status == "created"
}

// lookup returns sandbox id's current container, the runsc ID of its
// slot and the runsc ID of a retired slot ("" when there is none).
func (d *Driver) lookup(ctx context.Context, id string) (*gorunc.Container, string, string, error) {
	if id == "" {
		return nil, "", "", fmt.Errorf("gvisor: empty sandbox ID: %w", errdefs.ErrInvalidArgument)
	}
	var cs [2]*gorunc.Container
	ids := slotIDs(id)
	for i, rid := range ids {
		c, err := d.readSlot(ctx, id, rid)
		if errdefs.IsNotFound(err) {
			continue
		}
		if err != nil {
			return nil, "", "", err
		}
		cs[i] = c
	}
	switch {
	case cs[0] == nil && cs[1] == nil:
		return nil, "", "", fmt.Errorf("gvisor state %s: container %q does not exist: %w", id, ids[0], errdefs.ErrNotFound)
	case cs[1] == nil:
		return cs[0], ids[0], "", nil
	case cs[0] == nil:
		return cs[1], ids[1], "", nil
	}
	cur := 0
	if live(cs[0]) == live(cs[1]) {
		if cs[1].Created.After(cs[0].Created) {
			cur = 1
		}
	} else if live(cs[1]) {
		cur = 1
	}
	return cs[cur], ids[cur], ids[1-cur], nil
}

// readSlot reads the state of one slot from runsc's state file, or asks
// runsc when the file is in a layout readState does not know.
func (d *Driver) readSlot(ctx context.Context, id, rid string) (*gorunc.Container, error) {
	c, err := d.readState(ctx, id, rid)
	if !errors.Is(err, errStateFormat) {
		return c, err
	}
	d.stateFormatOnce.Do(func() {
		d.log.WarnContext(ctx, "runsc's state file is not in the known layout; asking runsc state instead (slower)", "id", id)
	})
	c, err = d.rsc("none", "").State(ctx, rid)
	if err != nil {
		return nil, d.classify(ctx, "state", id, err, "")
	}
	c.ID = id
	return c, nil
}

// slotsInRoot lists the sandboxes that have a state file in runsc's root,
// with the runsc IDs found for each.
func (d *Driver) slotsInRoot() (map[string][]string, error) {
	ents, err := os.ReadDir(d.root)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil // runsc makes its root at the first create
	}
	if err != nil {
		return nil, err
	}
	out := map[string][]string{}
	for _, e := range ents {
		name, ok := strings.CutSuffix(e.Name(), ".state")
		if !ok {
			continue
		}
		rid, cid, ok := strings.Cut(name, "_sandbox:")
		if !ok || rid != cid {
			continue
		}
		id := sandboxOfSlot(rid)
		out[id] = append(out[id], rid)
	}
	return out, nil
}
