package master

import (
	"context"
	"sync"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// expiryPerNode is how many deadline actions run at once on one node.
const expiryPerNode = 4

// expiryLoop enforces deadlines: every sandbox.expiry_interval it takes the
// running sandboxes past their end_at from the catalog (so deadlines
// survive a master restart) and kills them, or pauses those created with
// autoPause.
//
// Each node's deadlines are enforced by a worker of its own, each action
// bounded by sandbox.expiry_call_timeout: a node that accepts calls and
// never answers holds up its own sandboxes only, and while its worker
// runs no second one starts for it. A sandbox whose node fails the verb
// is retried with backoff.
func (s *Service) expiryLoop(ctx context.Context) {
	tick := time.NewTicker(s.cfg.Sandbox.ExpiryInterval.Duration)
	defer tick.Stop()
	e := &expiry{s: s, busy: map[string]bool{}, retry: map[string]time.Time{}}
	defer e.wg.Wait()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		now := time.Now()
		nodes, err := s.cat.ExpiredNodes(ctx, now)
		if err != nil {
			if ctx.Err() == nil {
				s.log.Error("expiry: read deadlines", "err", err)
			}
			continue
		}
		for _, node := range nodes {
			e.start(ctx, node, now)
		}
		e.prune(now)
	}
}

// expiry is the state of expiryLoop: the nodes with a worker running and
// the sandboxes waiting to be retried.
type expiry struct {
	s     *Service
	wg    sync.WaitGroup
	mu    sync.Mutex
	busy  map[string]bool      // node -> a worker runs
	retry map[string]time.Time // sandbox -> not before
}

// start runs a worker for node unless one runs already.
func (e *expiry) start(ctx context.Context, node string, now time.Time) {
	e.mu.Lock()
	if e.busy[node] {
		e.mu.Unlock()
		return
	}
	e.busy[node] = true
	e.mu.Unlock()
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		defer func() {
			e.mu.Lock()
			delete(e.busy, node)
			e.mu.Unlock()
		}()
		e.node(ctx, node, now)
	}()
}

// node acts on the sandboxes of one node past their deadline, a few at
// a time, each call bounded by sandbox.expiry_call_timeout.
func (e *expiry) node(ctx context.Context, node string, now time.Time) {
	s := e.s
	due, err := s.cat.ExpiredOn(ctx, node, now, 256)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Error("expiry: read deadlines", "node_id", node, "err", err)
		}
		return
	}
	sem := make(chan struct{}, expiryPerNode)
	var wg sync.WaitGroup
	for _, sb := range due {
		e.mu.Lock()
		t, waiting := e.retry[sb.ID]
		e.mu.Unlock()
		if waiting && now.Before(t) {
			continue
		}
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			wg.Wait()
			return
		}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			cctx, cancel := context.WithTimeout(ctx, s.cfg.Sandbox.ExpiryCallTimeout.Duration)
			err := s.expire(cctx, sb.ID)
			cancel()
			e.mu.Lock()
			defer e.mu.Unlock()
			if err == nil {
				delete(e.retry, sb.ID)
				return
			}
			if ctx.Err() != nil {
				return
			}
			s.log.Warn("expiry failed; will retry", "sandbox_id", sb.ID, "node_id", node, "err", err)
			e.retry[sb.ID] = time.Now().Add(min(10*time.Second, 20*s.cfg.Sandbox.ExpiryInterval.Duration))
		}()
	}
	wg.Wait()
}

// prune forgets retries of sandboxes long gone.
func (e *expiry) prune(now time.Time) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for id, t := range e.retry {
		if now.Sub(t) > time.Hour {
			delete(e.retry, id)
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
	// Only the lease's holder acts on deadlines; checked last, right
	// before the node is told.
	if err := s.fence(ctx); err != nil {
		return err
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
