package master

import (
	"context"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// expiryLoop enforces deadlines: every sandbox.expiry_interval it takes the
// running sandboxes past their end_at from the catalog (so deadlines
// survive a master restart) and kills them, or pauses those created with
// autoPause. A sandbox whose node fails the verb is retried with backoff.
func (s *Service) expiryLoop(ctx context.Context) {
	tick := time.NewTicker(s.cfg.Sandbox.ExpiryInterval.Duration)
	defer tick.Stop()
	retry := map[string]time.Time{} // sandbox -> not before
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		now := time.Now()
		due, err := s.cat.Expired(ctx, now, 256)
		if err != nil {
			if ctx.Err() == nil {
				s.log.Error("expiry: read deadlines", "err", err)
			}
			continue
		}
		for _, sb := range due {
			if t, ok := retry[sb.ID]; ok && now.Before(t) {
				continue
			}
			if err := s.expire(ctx, sb.ID); err != nil {
				if ctx.Err() != nil {
					return
				}
				s.log.Warn("expiry failed; will retry", "sandbox_id", sb.ID, "node_id", sb.NodeID, "err", err)
				retry[sb.ID] = now.Add(min(10*time.Second, 20*s.cfg.Sandbox.ExpiryInterval.Duration))
				continue
			}
			delete(retry, sb.ID)
		}
		for id, t := range retry {
			if now.Sub(t) > time.Hour {
				delete(retry, id)
			}
		}
	}
}

// expire acts on one sandbox whose deadline passed, re-checking under its
// lock: a connect or timeout change may have moved the deadline meanwhile.
func (s *Service) expire(ctx context.Context, id string) error {
	sb, unlock, err := s.lockSandbox(ctx, id)
	if errdefs.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	defer unlock()
	if sb.EndAt.After(time.Now()) || sb.State != catalog.StateRunning && sb.State != catalog.StateFailed {
		return nil
	}
	if sb.State == catalog.StateFailed {
		return s.kill(ctx, sb, "removed at its deadline (it had died)")
	}
	if sb.AutoPause {
		if err := s.pause(ctx, sb); err != nil {
			return err
		}
		s.event(id, "info", "timeout reached: sandbox paused", nil)
		s.log.Info("sandbox paused at its deadline", "sandbox_id", id)
		return nil
	}
	return s.kill(ctx, sb, "killed at its deadline")
}
