package master

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// Drain empties a node for maintenance: it is cordoned, then each of its
// sandboxes moves to another node under the same ID (and so the same URL
// through the route), keeping its state:
//
//   - a running one is paused, moved (moveElsewhere: snapshot, export,
//     import on the best node the scheduler ranks, clone under its ID and
//     token) and runs again there with the deadline it had. A move that
//     fails resumes it where it was, so its clients saw a pause.
//   - a paused one is moved the same way and paused again on its new
//     node.
//
// With DrainOptions.Wait running sandboxes are not moved: the drain waits
// for them to end (their deadline, a kill); paused ones still move (no
// process of theirs is interrupted).
//
// Before anything changes, every sandbox to move must have a node that
// could take it (moveTargets); otherwise the drain is refused
// (FailedPrecondition naming each sandbox and each node's reason) and the
// node is left as it was. A sandbox whose move fails is reported and
// left on the node; the drain goes on with the others and ends with an
// error naming the ones left. Sandboxes that appear on the node while it
// drains (creates already under way when it was cordoned) are taken up
// too. A drain runs as long as its caller's context; running it again
// continues where it stopped. It ends once the moved sandboxes' originals
// are destroyed (a move answers before that).

// DrainOptions shape a drain.
type DrainOptions struct {
	// Wait leaves running sandboxes to end rather than moving them.
	Wait bool
	// Parallel is how many sandboxes move at once (default 4).
	Parallel int
	// RequestWait bounds how long a running sandbox's move waits for the
	// requests in flight to it to finish before it freezes (holdTraffic):
	// 0 is the master's [drain] request_wait, negative no wait; past
	// MaxRequestWait the drain is refused (InvalidArgument).
	RequestWait time.Duration
}

// Drain phases reported in DrainEvent.Phase.
const (
	DrainMoving  = "moving"  // a move began
	DrainMoved   = "moved"   // the sandbox runs (or is paused) on To
	DrainFailed  = "failed"  // the move failed; the sandbox stays on the node (Err)
	DrainWaiting = "waiting" // Wait: a running sandbox is left to end
	DrainEnded   = "ended"   // the sandbox ended (killed, expired) while the drain ran
	DrainDone    = "done"    // the last event: the node holds none of the drained sandboxes
)

// DrainEvent is one step of a drain, for the caller's progress display.
type DrainEvent struct {
	NodeID    string
	SandboxID string
	// State is the sandbox's state when the drain took it up.
	State string
	Phase string
	To    string
	Err   string
	// Took is how long the move took (moved, failed).
	Took time.Duration
	// Remaining is how many of the node's sandboxes were still there
	// after this event (failed ones included); Total how many the drain
	// has taken up so far.
	Remaining, Total int
}

// Drain cordons nodeID and moves its sandboxes elsewhere, calling
// progress (serially) for each step. It returns once the node holds none
// of its running or paused sandboxes, or with an error naming those left.
func (s *Service) Drain(ctx context.Context, nodeID string, o DrainOptions, progress func(DrainEvent)) error {
	if o.Parallel <= 0 {
		o.Parallel = 4
	}
	if o.RequestWait > MaxRequestWait {
		return errdefs.FieldErrorf("request_wait_ms", "%s is past the most, %s", o.RequestWait, MaxRequestWait)
	}
	if !s.nodeKnown(nodeID) {
		return fmt.Errorf("node %q: %w", nodeID, errdefs.ErrNotFound)
	}
	rows, err := s.drainRows(ctx, nodeID)
	if err != nil {
		return err
	}
	var refused []error
	for _, sb := range rows {
		if o.Wait && sb.State != catalog.StatePaused {
			continue
		}
		if err := s.pinnedByVolumes(ctx, sb); err != nil {
			refused = append(refused, err)
			continue
		}
		if cands, rejs := s.moveTargets(nodeID, sb); len(cands) == 0 {
			refused = append(refused, noTarget(sb, rejs))
		}
	}
	if len(refused) > 0 {
		return fmt.Errorf("drain of node %s refused, nothing changed: %w", nodeID, errors.Join(refused...))
	}
	if _, err := s.SetSchedulable(ctx, nodeID, false); err != nil {
		return err
	}
	s.log.Info("drain: node cordoned", "node_id", nodeID, "sandboxes", len(rows), "wait", o.Wait)

	var mu sync.Mutex // progress, seen, failed
	seen := map[string]string{}
	failed := map[string]error{}
	report := func(ev DrainEvent) {
		ev.NodeID = nodeID
		ev.Total = len(seen)
		if progress != nil {
			progress(ev)
		}
	}
	sem := make(chan struct{}, o.Parallel)
	var wg sync.WaitGroup
	for {
		rows, err := s.drainRows(ctx, nodeID)
		if err != nil {
			wg.Wait()
			return err
		}
		left := map[string]bool{}
		for _, sb := range rows {
			left[sb.ID] = true
		}
		mu.Lock()
		// Those taken up before and gone now (without a move: a kill,
		// the deadline) ended.
		for id, st := range seen {
			if !left[id] && st != DrainMoved && st != DrainMoving && st != DrainEnded {
				seen[id] = DrainEnded
				report(DrainEvent{SandboxID: id, Phase: DrainEnded, Remaining: len(rows)})
			}
		}
		pending := 0
		for _, sb := range rows {
			if _, bad := failed[sb.ID]; bad {
				continue
			}
			pending++
			if st, ok := seen[sb.ID]; ok && st != DrainWaiting {
				continue // in flight
			}
			if sb.State == catalog.StateCreating {
				continue // taken up once it runs
			}
			if o.Wait && sb.State == catalog.StateRunning {
				if _, ok := seen[sb.ID]; !ok {
					seen[sb.ID] = DrainWaiting
					report(DrainEvent{SandboxID: sb.ID, State: sb.State, Phase: DrainWaiting, Remaining: len(rows)})
				}
				continue
			}
			seen[sb.ID] = DrainMoving
			report(DrainEvent{SandboxID: sb.ID, State: sb.State, Phase: DrainMoving, Remaining: len(rows)})
			wg.Add(1)
			go func(sb *catalog.Sandbox) {
				defer wg.Done()
				select {
				case sem <- struct{}{}:
				case <-ctx.Done():
					return
				}
				defer func() { <-sem }()
				began := time.Now()
				to, err := s.drainOne(ctx, nodeID, sb.ID, o.RequestWait)
				remaining, _ := s.drainRows(ctx, nodeID)
				mu.Lock()
				defer mu.Unlock()
				ev := DrainEvent{SandboxID: sb.ID, State: sb.State, To: to, Took: time.Since(began), Remaining: len(remaining)}
				switch {
				case err == nil && to == "":
					seen[sb.ID], ev.Phase = DrainEnded, DrainEnded
				case to != "":
					// Moved (err: it could not be paused again there).
					seen[sb.ID], ev.Phase = DrainMoved, DrainMoved
					if err != nil {
						ev.Err = err.Error()
					}
				default:
					failed[sb.ID] = err
					seen[sb.ID], ev.Phase, ev.Err = DrainFailed, DrainFailed, err.Error()
				}
				report(ev)
			}(sb)
		}
		mu.Unlock()
		if pending == 0 {
			break
		}
		select {
		case <-ctx.Done():
			wg.Wait()
			return fmt.Errorf("drain of node %s stopped with sandboxes left (the node stays cordoned; drain again to go on): %w", nodeID, ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	// A move answers before its original is destroyed (tidyAfterMove):
	// the node is empty once those are done.
	for id, st := range seen {
		if st == DrainMoved {
			if err := s.waitLeft(ctx, id); err != nil {
				return fmt.Errorf("drain of node %s: %w", nodeID, err)
			}
		}
	}
	if len(failed) > 0 {
		var errs []error
		for id, err := range failed {
			errs = append(errs, fmt.Errorf("sandbox %s: %w", id, err))
		}
		return fmt.Errorf("drain of node %s: %d sandboxes could not move and stay on it (cordoned): %w", nodeID, len(failed), errors.Join(errs...))
	}
	report(DrainEvent{Phase: DrainDone})
	s.log.Info("drain: node empty", "node_id", nodeID, "sandboxes", len(seen))
	return nil
}

// drainRows are the node's sandboxes a drain takes up.
func (s *Service) drainRows(ctx context.Context, nodeID string) ([]*catalog.Sandbox, error) {
	rows, _, err := s.cat.ListSandboxes(ctx, catalog.Query{NodeID: nodeID,
		States: []string{catalog.StateCreating, catalog.StateRunning, catalog.StatePaused}})
	return rows, err
}

// drainOne moves one sandbox off nodeID under its lock and returns where
// it went ("" when it was gone or no longer there: nothing to move).
func (s *Service) drainOne(ctx context.Context, nodeID, id string, requestWait time.Duration) (string, error) {
	unlock, err := s.locks.lock(ctx, id)
	if err != nil {
		return "", err
	}
	defer unlock()
	// Marked before the row is read: another replica's move of it is
	// waited for first.
	unmark, err := s.markMoving(ctx, id)
	if err != nil {
		return "", err
	}
	defer unmark()
	sb, err := s.cat.GetSandbox(ctx, id)
	if errdefs.IsNotFound(err) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	if sb.NodeID != nodeID || (sb.State != catalog.StateRunning && sb.State != catalog.StatePaused) {
		return "", nil
	}
	wasRunning := sb.State == catalog.StateRunning
	if wasRunning {
		// New requests wait for the move; those in flight get up to
		// requestWait to finish where it is (quiesce.go). A paused
		// sandbox has nothing in flight.
		if requestWait == 0 {
			requestWait = s.cfg.Drain.RequestWait.Duration
		}
		if took, open := s.holdTraffic(ctx, id, requestWait); open != "" || took > 100*time.Millisecond {
			s.event(id, "info", "drain: traffic held before the freeze", map[string]string{"waited": took.Round(time.Millisecond).String(), "still_open": open})
		}
		// Not exported at this pause (store.export_on_pause): the move
		// takes a snapshot of its own.
		if err := s.pauseAndExport(ctx, sb, false); err != nil {
			return "", fmt.Errorf("pause: %w", err)
		}
		sb.State = catalog.StatePaused
	}
	endAt := sb.EndAt
	if !wasRunning || endAt.Before(time.Now()) {
		// A paused sandbox has no deadline while it is paused; it runs
		// on its new node only until it is paused again there.
		endAt = time.Now().UTC().Add(s.cfg.Sandbox.V1DefaultTimeout.Duration)
	}
	moved, err := s.moveElsewhere(ctx, sb, endAt)
	if err != nil {
		if wasRunning {
			// Back to running where it was: its clients saw a pause.
			if _, rerr := s.resumeHere(context.WithoutCancel(ctx), sb, max(time.Until(sb.EndAt), time.Second)); rerr != nil {
				return "", fmt.Errorf("%w; resuming it on node %s failed too (it stays paused there): %w", err, nodeID, rerr)
			}
		}
		return "", err
	}
	if !wasRunning {
		if err := s.pause(ctx, moved); err != nil {
			return moved.NodeID, fmt.Errorf("moved to node %s, but pausing it again there failed (it runs there): %w", moved.NodeID, err)
		}
	}
	s.event(id, "info", "sandbox moved off a draining node", map[string]string{"from": nodeID, "to": moved.NodeID})
	return moved.NodeID, nil
}

// nodeKnown reports whether nodeID is registered.
func (s *Service) nodeKnown(nodeID string) bool {
	s.reg.mu.Lock()
	defer s.reg.mu.Unlock()
	_, ok := s.reg.nodes[nodeID]
	return ok
}
