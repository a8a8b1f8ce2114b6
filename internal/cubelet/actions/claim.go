package actions

import (
	"context"
	"fmt"

	"github.com/cubesandbox/cube/internal/cubelet/agentclient"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// FailpointClaimReinit is evaluated by a claim after the entry's thaw,
// limits, hostname and policy, before the agent's reinit.
const FailpointClaimReinit = "pool/claim.agent/before"

// ApplyClaim turns a frozen warm pool entry (prev, its record before the
// claim) into the sandbox t records, which holds the entry's container,
// disk and network slot: thaw, the sandbox's limits, hostname and network
// policy, then the agent's reinit (env, access token, clock, entropy),
// after which it is what a cold create of the same request would be.
// step times each part. It writes no record.
func (n *Node) ApplyClaim(ctx context.Context, t *Task, prev *sandbox.Record, step func(string, func() error) error) error {
	rec := t.Record()
	d, err := n.Driver(rec.Runtime)
	if err != nil {
		return err
	}
	cid := rec.Container.ID
	// Thawed first: a thawed entry is never taken back as ready, so the
	// caller can write the sandbox's record meanwhile, and a crash
	// between here and that write leaves nothing another create could
	// claim with this sandbox's limits, hostname or policy. The agent is
	// idle until the reinit, so nothing runs with the entry's settings.
	if err := step("thaw", func() error {
		return Settle(ctx, d, cid, runtime.StatusRunning, d.Resume(ctx, cid))
	}); err != nil {
		return err
	}
	if rec.Resources != prev.Resources {
		u, ok := d.(runtime.LimitUpdater)
		if !ok {
			return fmt.Errorf("runtime %s cannot change limits: %w", rec.Runtime, errdefs.ErrFailedPrecondition)
		}
		l := runtime.Limits{MilliCPU: rec.Resources.MilliCPU, MemoryMiB: rec.Resources.MemoryMiB, Pids: rec.Resources.Pids}
		if err := step("limits", func() error { return u.UpdateLimits(ctx, cid, l) }); err != nil {
			return err
		}
	}
	if h, ok := d.(runtime.HostnameSetter); ok {
		if err := step("hostname", func() error { return h.SetHostname(ctx, cid, rec.Container.PID, rec.ID) }); err != nil {
			return err
		}
	}
	if rec.NetworkPolicy != nil && rec.Network != nil {
		if err := step("net", func() error { return n.Net.UpdatePolicy(ctx, rec.HostKey(), rec.NetworkPolicy) }); err != nil {
			return err
		}
	}
	if err := failpoint.Eval(ctx, FailpointClaimReinit); err != nil {
		return err
	}
	return step("agent", func() error {
		// The env a cold create's spec would carry (CUBE_SANDBOX_ID
		// included); the agent adds it to what its processes get. The
		// hostname too, which the agent sets where the runtime lets it
		// (gVisor) and a HostnameSetter has set already. Bounded like
		// any wait for an agent: a VM entry's spare session runs no
		// health pings, and the create's context may have no deadline.
		spec := specOf(rec, rec.Container, t.Template)
		wctx, cancel := n.agentWait(ctx, rec)
		defer cancel()
		return withWaitCause(wctx, agentclient.Reinit(wctx, d, rec, prev.AccessToken, rec.ID, spec.Env, false))
	})
}
