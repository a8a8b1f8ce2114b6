package master

import (
	"context"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// noteDead records the sandboxes a node reports dead (its runtime watch
// saw the process die, or a verb failed beyond undo): the row turns
// failed, with an event saying why, and stays until a kill or its
// deadline removes it. Reports repeat the list until the node's record
// goes, so this is idempotent and a restarted master catches up at the
// first heartbeat. Runs in the background: the caller holds reg.mu.
func (s *Service) noteDead(nodeID string, dead []*masterpb.DeadSandbox) {
	s.goBackground(func(ctx context.Context) {
		for _, d := range dead {
			s.markFailed(ctx, nodeID, d)
		}
	})
}

func (s *Service) markFailed(ctx context.Context, nodeID string, d *masterpb.DeadSandbox) {
	live := func(sb *catalog.Sandbox) bool {
		return sb.NodeID == nodeID && (sb.State == catalog.StateRunning || sb.State == catalog.StatePaused)
	}
	if sb, err := s.cat.GetSandbox(ctx, d.SandboxId); err != nil || !live(sb) {
		return
	}
	unlock, err := s.locks.lock(ctx, d.SandboxId)
	if err != nil {
		return
	}
	defer unlock()
	// A move by another replica: the copy that died may be the original
	// it leaves; the row read after the move says.
	if _, err := s.awaitMove(ctx, d.SandboxId, verbMoveWait, errdefs.ErrUnavailable); err != nil {
		return
	}
	sb, err := s.cat.GetSandbox(ctx, d.SandboxId)
	if err != nil || !live(sb) {
		return
	}
	if _, err := s.cat.UpdateSandbox(ctx, sb.ID, func(r *catalog.Sandbox) error { r.State = catalog.StateFailed; return nil }); err != nil {
		s.log.Warn("record a dead sandbox", "sandbox_id", sb.ID, "node_id", nodeID, "err", err)
		return
	}
	s.routes.drop(sb.ID)
	reason := d.Reason
	if reason == "" {
		reason = "sandbox failed on its node"
	}
	s.event(sb.ID, "error", reason, map[string]string{"node": nodeID, "died_at": d.GetDiedAt().AsTime().Format("2006-01-02T15:04:05.000Z07:00")})
	s.log.Warn("sandbox died on its node", "sandbox_id", sb.ID, "node_id", nodeID, "reason", reason)
}
