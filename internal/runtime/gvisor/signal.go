package gvisor

import (
	"context"

	"golang.org/x/sys/unix"
)

// WakeSignal is what WakeAgent sends: cube-agent (PID 1) listens again on
// it after a quiesce (internal/agent/quiesce.go), and does not forward it.
const WakeSignal = unix.SIGUSR2

// WakeAgent sends WakeSignal to the sandbox's PID 1 (runsc kill without
// --all reaches only the container's init). cubelet calls it after every
// restore from a memory image taken with the agent quiesced, and when a
// snapshot is given up before its checkpoint.
func (d *Driver) WakeAgent(ctx context.Context, id string) error {
	c, rid, _, err := d.lookup(ctx, id)
	if err != nil {
		return err
	}
	if err := d.rsc(networkOf(c.Bundle), "").Kill(ctx, rid, int(WakeSignal), nil); err != nil {
		return d.classify(ctx, "wake agent", id, err, "")
	}
	return nil
}
