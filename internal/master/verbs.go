package master

import (
	"context"
	"errors"
	"fmt"
	"time"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// visible hides sandboxes that are still being created: to clients a
// sandbox exists once Create returned it.
func visible(sb *catalog.Sandbox) bool { return sb.State != catalog.StateCreating }

// Get returns one sandbox.
func (s *Service) Get(ctx context.Context, id string) (*catalog.Sandbox, error) {
	sb, err := s.cat.GetSandbox(ctx, id)
	if err != nil {
		return nil, err
	}
	if !visible(sb) || !inScope(ctx, sb.Team) {
		return nil, notFound("sandbox", id)
	}
	return sb, nil
}

// List returns a page of sandboxes; with no states, running and paused.
func (s *Service) List(ctx context.Context, q catalog.Query) ([]*catalog.Sandbox, string, error) {
	if len(q.States) == 0 {
		q.States = []string{catalog.StateRunning, catalog.StatePaused}
	}
	if t := TeamOf(ctx); t != "" {
		q.Team = t
	}
	for _, st := range q.States {
		if st != catalog.StateRunning && st != catalog.StatePaused {
			return nil, "", errdefs.FieldErrorf("state", "%q: want running or paused", st)
		}
	}
	if err := ValidateMetadata(q.Metadata); err != nil {
		return nil, "", err
	}
	return s.cat.ListSandboxes(ctx, q)
}

// ListAll is the admin listing: every row, creating ones included.
func (s *Service) ListAll(ctx context.Context, q catalog.Query) ([]*catalog.Sandbox, error) {
	out, _, err := s.cat.ListSandboxes(ctx, q)
	return out, err
}

// lockSandbox takes the sandbox's verb lock and reads its row.
func (s *Service) lockSandbox(ctx context.Context, id string) (*catalog.Sandbox, func(), error) {
	unlock, err := s.locks.lock(ctx, id)
	if err != nil {
		return nil, nil, err
	}
	s.activity.touch(id, time.Now()) // API traffic keeps a sandbox awake
	// Another replica moving it: wait, then act on where it is now.
	if _, err := s.awaitMove(ctx, id, verbMoveWait, errdefs.ErrUnavailable); err != nil {
		unlock()
		return nil, nil, err
	}
	sb, err := s.Get(ctx, id)
	if err != nil {
		unlock()
		return nil, nil, err
	}
	return sb, unlock, nil
}

// Kill destroys a sandbox. If its node is gone (unhealthy and
// unreachable), the row is dropped anyway and the node deletes the sandbox
// when it registers again (reconcile: managed sandboxes without a row).
func (s *Service) Kill(ctx context.Context, id string) error {
	sb, unlock, err := s.lockSandbox(ctx, id)
	if err != nil {
		return err
	}
	defer unlock()
	return s.kill(ctx, sb, "killed")
}

func (s *Service) kill(ctx context.Context, sb *catalog.Sandbox, why string) error {
	s.routes.drop(sb.ID)
	if err := fpKillBegin.Eval(ctx); err != nil {
		return err
	}
	del := func(ctx context.Context, c cubeletpb.CubeletServiceClient) error {
		_, err := c.DeleteSandbox(ctx, &cubeletpb.DeleteSandboxRequest{RequestId: sb.ID, SandboxId: sb.ID})
		return err
	}
	err := s.onNode(ctx, sb, del)
	// The connection broke under the call (a cubelet killed just then,
	// or one starting up): a delete may be repeated, so it is, while the
	// node stays healthy, for up to nodes.restart_wait.
	for until := time.Now().Add(s.cfg.Nodes.RestartWait.Duration); errdefs.IsUnavailable(err) && s.nodeHealthy(sb.NodeID) && time.Now().Before(until); {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
		err = s.onNode(ctx, sb, del)
	}
	switch {
	case err == nil, errdefs.IsNotFound(err):
	case errdefs.IsUnavailable(err) && !s.nodeHealthy(sb.NodeID):
		s.log.Warn("node unreachable; sandbox dropped from the catalog, the node deletes it when it returns",
			"sandbox_id", sb.ID, "node_id", sb.NodeID, "err", err)
	default:
		return err
	}
	if err := fpKillDeleted.Eval(ctx); err != nil {
		return err
	}
	if err := s.cat.DeleteSandbox(ctx, sb.ID); err != nil && !errdefs.IsNotFound(err) {
		return err
	}
	if sb.PauseSnapshot != "" {
		s.dropExported(ctx, sb.PauseSnapshot, sb.NodeID)
	}
	if err := fpKillDone.Eval(ctx); err != nil {
		return err
	}
	s.routes.drop(sb.ID)
	s.activity.forget(sb.ID)
	s.log.Info("sandbox "+why, "sandbox_id", sb.ID, "node_id", sb.NodeID)
	return nil
}

// onNode calls the sandbox's node with errors classified.
//
// A node whose connection is down (its cubelet restarting) is waited for,
// up to nodes.restart_wait, before the call (awaitNode): the call is made
// once, so a verb that is not idempotent is never repeated.
func (s *Service) onNode(ctx context.Context, sb *catalog.Sandbox, fn func(context.Context, cubeletpb.CubeletServiceClient) error) error {
	c, err := s.client(sb.NodeID)
	if err != nil {
		return err
	}
	s.awaitNode(ctx, sb.NodeID)
	return fromGRPC(sb.NodeID, fn(ctx, c))
}

// Pause freezes a running sandbox. Already paused: FailedPrecondition.
func (s *Service) Pause(ctx context.Context, id string) error {
	sb, unlock, err := s.lockSandbox(ctx, id)
	if err != nil {
		return err
	}
	defer unlock()
	return s.pause(ctx, sb)
}

func (s *Service) pause(ctx context.Context, sb *catalog.Sandbox) error {
	return s.pauseAndExport(ctx, sb, s.cfg.Store.ExportOnPause)
}

// pauseAndExport is pause, exporting the paused sandbox's snapshot
// (exportPaused) when export is set.
func (s *Service) pauseAndExport(ctx context.Context, sb *catalog.Sandbox, export bool) error {
	if sb.State != catalog.StateRunning {
		return fmt.Errorf("sandbox %s is %s: %w", sb.ID, sb.State, errdefs.ErrFailedPrecondition)
	}
	s.routes.drop(sb.ID)
	if err := fpPauseBegin.Eval(ctx); err != nil {
		return err
	}
	err := s.onNode(ctx, sb, func(ctx context.Context, c cubeletpb.CubeletServiceClient) error {
		_, err := c.PauseSandbox(ctx, &cubeletpb.PauseSandboxRequest{RequestId: sb.ID, SandboxId: sb.ID})
		return err
	})
	if err != nil && !s.nodeSays(ctx, sb, cubeletpb.SandboxState_SANDBOX_STATE_PAUSED) {
		return err
	}
	if err := fpPausePaused.Eval(ctx); err != nil {
		return err
	}
	if _, err := s.cat.UpdateSandbox(ctx, sb.ID, func(r *catalog.Sandbox) error { r.State = catalog.StatePaused; return nil }); err != nil {
		return err
	}
	if err := fpPauseDone.Eval(ctx); err != nil {
		return err
	}
	s.routes.drop(sb.ID)
	s.event(sb.ID, "info", "sandbox paused", nil)
	if export {
		paused := *sb
		paused.State = catalog.StatePaused
		s.exportPaused(ctx, &paused)
	}
	return nil
}

// nodeSays reports whether the node holds the sandbox in state want: a
// verb that "failed" because the sandbox already was where the caller
// wanted it (another master call raced) is not a failure.
func (s *Service) nodeSays(ctx context.Context, sb *catalog.Sandbox, want cubeletpb.SandboxState) bool {
	var got cubeletpb.SandboxState
	err := s.onNode(ctx, sb, func(ctx context.Context, c cubeletpb.CubeletServiceClient) error {
		resp, err := c.GetSandbox(ctx, &cubeletpb.GetSandboxRequest{SandboxId: sb.ID})
		if err == nil {
			got = resp.Sandbox.State
		}
		return err
	})
	return err == nil && got == want
}

// Resume thaws a paused sandbox and gives it a new deadline. Running:
// FailedPrecondition (E2B answers 409).
func (s *Service) Resume(ctx context.Context, id string, timeout time.Duration) (*catalog.Sandbox, error) {
	if timeout == 0 {
		timeout = s.cfg.Sandbox.V1DefaultTimeout.Duration
	}
	if err := s.validateTimeout("timeout", timeout); err != nil {
		return nil, err
	}
	sb, unlock, err := s.lockSandbox(ctx, id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if sb.State != catalog.StatePaused {
		return nil, fmt.Errorf("sandbox %s is already %s: %w", id, sb.State, errdefs.ErrFailedPrecondition)
	}
	return s.resume(ctx, sb, timeout)
}

func (s *Service) resume(ctx context.Context, sb *catalog.Sandbox, timeout time.Duration) (*catalog.Sandbox, error) {
	s.routes.drop(sb.ID)
	if sb.PauseSnapshot != "" && s.nodeLost(sb.NodeID) {
		// Its node is gone: start it elsewhere from the snapshot
		// exported as it paused.
		return s.restoreElsewhere(ctx, sb, timeout)
	}
	if s.nodeCordoned(sb.NodeID) {
		// A move that fails leaves the sandbox paused where it is, which
		// can still resume it there (cordoned takes nothing new).
		up, err := s.resumeElsewhere(ctx, sb, timeout)
		if err == nil {
			return up, nil
		}
		if errors.Is(err, errMoveLeaseLost) {
			// Another replica may be moving it now: resuming it here
			// would race that move.
			return nil, err
		}
		s.log.Warn("resume on another node failed; resuming on the cordoned node", "sandbox_id", sb.ID, "node_id", sb.NodeID, "err", err)
	}
	return s.resumeHere(ctx, sb, timeout)
}

// resumeHere resumes a paused sandbox on the node it is on.
func (s *Service) resumeHere(ctx context.Context, sb *catalog.Sandbox, timeout time.Duration) (*catalog.Sandbox, error) {
	s.routes.drop(sb.ID)
	if err := fpResumeBegin.Eval(ctx); err != nil {
		return nil, err
	}
	err := s.onNode(ctx, sb, func(ctx context.Context, c cubeletpb.CubeletServiceClient) error {
		_, err := c.ResumeSandbox(ctx, &cubeletpb.ResumeSandboxRequest{RequestId: sb.ID, SandboxId: sb.ID})
		return err
	})
	if err != nil && !s.nodeSays(ctx, sb, cubeletpb.SandboxState_SANDBOX_STATE_RUNNING) {
		return nil, err
	}
	if err := fpResumeResumed.Eval(ctx); err != nil {
		return nil, err
	}
	stale := ""
	up, err := s.cat.UpdateSandbox(ctx, sb.ID, func(r *catalog.Sandbox) error {
		stale = r.PauseSnapshot
		r.State, r.EndAt, r.PauseSnapshot = catalog.StateRunning, time.Now().UTC().Add(timeout), ""
		return nil
	})
	if err != nil {
		return nil, err
	}
	if stale != "" {
		// Running again: the snapshot exported at its pause is stale.
		s.dropExported(ctx, stale, sb.NodeID)
	}
	if err := fpResumeDone.Eval(ctx); err != nil {
		return nil, err
	}
	s.routes.drop(sb.ID)
	s.activity.touch(sb.ID, time.Now())
	s.event(sb.ID, "info", "sandbox resumed", map[string]string{"timeout": timeout.String()})
	return up, nil
}

// Connect returns a sandbox ready to use: a running one gets its deadline
// extended to at least now+timeout (never shortened); a paused one is
// resumed with deadline now+timeout. resumed says which happened.
func (s *Service) Connect(ctx context.Context, id string, timeout time.Duration) (sb *catalog.Sandbox, resumed bool, err error) {
	if timeout == 0 {
		timeout = s.cfg.Sandbox.DefaultTimeout.Duration
	}
	if err := s.validateTimeout("timeout", timeout); err != nil {
		return nil, false, err
	}
	sb, unlock, err := s.lockSandbox(ctx, id)
	if err != nil {
		return nil, false, err
	}
	defer unlock()
	if sb.State == catalog.StatePaused {
		sb, err = s.resume(ctx, sb, timeout)
		return sb, err == nil, err
	}
	if sb.State == catalog.StateFailed {
		return nil, false, s.failedError(ctx, sb)
	}
	sb, err = s.extend(ctx, id, timeout, false)
	return sb, false, err
}

// failedError says why a failed sandbox cannot be used: the latest error
// event (its process died, its node was lost).
func (s *Service) failedError(ctx context.Context, sb *catalog.Sandbox) error {
	why := "its process died or its node was lost"
	if evs, err := s.cat.ListEvents(ctx, catalog.EventQuery{SandboxID: sb.ID, Backward: true, Limit: 20}); err == nil {
		for _, ev := range evs {
			if ev.Level == "error" {
				why = ev.Message
				break
			}
		}
	}
	return fmt.Errorf("sandbox %s failed on node %s (%s); it cannot be resumed, kill it: %w", sb.ID, sb.NodeID, why, errdefs.ErrFailedPrecondition)
}

// SetTimeout sets the deadline to now+timeout, shorter or longer.
func (s *Service) SetTimeout(ctx context.Context, id string, timeout time.Duration) error {
	if timeout <= 0 {
		return errdefs.FieldErrorf("timeout", "must be at least one second")
	}
	if err := s.validateTimeout("timeout", timeout); err != nil {
		return err
	}
	_, err := s.extend(ctx, id, timeout, true)
	if err == nil {
		s.event(id, "info", "timeout set", map[string]string{"timeout": timeout.String()})
	}
	return err
}

// Refresh extends the deadline to now+d unless it is already later.
func (s *Service) Refresh(ctx context.Context, id string, d time.Duration) error {
	if d == 0 {
		d = s.cfg.Sandbox.V1DefaultTimeout.Duration
	}
	if err := s.validateTimeout("duration", d); err != nil {
		return err
	}
	_, err := s.extend(ctx, id, d, false)
	return err
}

func (s *Service) extend(ctx context.Context, id string, d time.Duration, allowShorter bool) (*catalog.Sandbox, error) {
	s.activity.touch(id, time.Now())
	return s.cat.UpdateSandbox(ctx, id, func(r *catalog.Sandbox) error {
		if !visible(r) || !inScope(ctx, r.Team) {
			return notFound("sandbox", id)
		}
		if end := time.Now().UTC().Add(d); allowShorter || end.After(r.EndAt) {
			r.EndAt = end
		}
		return nil
	})
}

// UpdateNetwork replaces a sandbox's egress rules. Credential and request
// rules given at create stay unless n names its own (nil keeps them).
func (s *Service) UpdateNetwork(ctx context.Context, id string, n catalog.Network) error {
	if err := ValidateNetwork(n); err != nil {
		return err
	}
	sb, unlock, err := s.lockSandbox(ctx, id)
	if err != nil {
		return err
	}
	defer unlock()
	if n.Credentials == nil {
		n.Credentials = sb.Network.Credentials
	}
	if n.Requests == nil {
		n.Requests = sb.Network.Requests
	}
	netPolicy, err := s.nodeNetwork(ctx, sb.Team, n)
	if err != nil {
		return err
	}
	err = s.onNode(ctx, sb, func(ctx context.Context, c cubeletpb.CubeletServiceClient) error {
		_, err := c.UpdateSandboxNetwork(ctx, &cubeletpb.UpdateSandboxNetworkRequest{SandboxId: id, Policy: netPolicy})
		return err
	})
	if err != nil {
		return err
	}
	// The traffic rule is not an egress rule: keep it.
	n.AllowPublicTraffic = sb.Network.AllowPublicTraffic
	_, err = s.cat.UpdateSandbox(ctx, id, func(r *catalog.Sandbox) error { r.Network = n; return nil })
	if err == nil {
		s.event(id, "info", "network updated", nil)
	}
	return err
}

// Events returns a sandbox's lifecycle log.
func (s *Service) Events(ctx context.Context, q catalog.EventQuery) ([]catalog.Event, error) {
	if _, err := s.Get(ctx, q.SandboxID); err != nil {
		return nil, err
	}
	return s.cat.ListEvents(ctx, q)
}
