package master

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"
)

// Before a running sandbox freezes for a move (a drain), its traffic is
// quiesced through the proxies, on the channels they already have with
// the masters (route events and activity reports):
//
//  1. Hold. The move is marked (markMoving: this replica's moving set,
//     and on a shared catalog the lease move/<id>), so every route
//     resolve for the sandbox, on any replica, waits for the move and
//     goes where the sandbox runs after it. The route is then dropped
//     with a quiesce event (routeCache.quiesce): the proxies watching
//     this replica drop their cached route at once, and the other
//     replicas, reading the change from the catalog, find the move's
//     lease held and pass it on to theirs as a quiesce too.
//  2. Drain. A proxy answers a quiesce event, after dropping the route,
//     with an activity report marked quiesced holding the requests and
//     streams it has open to the sandbox (each of which can still reach
//     the original), and reports again the moment none is left. The
//     move waits until every proxy watching this replica when the hold
//     began has answered and none has anything open, and, on a shared
//     catalog, until every other replica that wrote traffic for the
//     sandbox within openStale has written its row again (it does on the
//     quiesce event and on each quiesced report of its proxies) with
//     nothing open. The wait is bounded by [drain] request_wait; past it
//     the sandbox freezes with what is left open, which the proxies' rules
//     for a cut request handle (docs/proxy.md).
//  3. Freeze: the move goes on (pause, snapshot, ...).
//
// A sandbox with nothing in flight costs one round trip to each watching
// proxy (and, on a shared catalog, one read of its traffic rows, plus
// one route poll and write of each replica that served it recently).

// quiesceRowPoll is how often the traffic rows of other replicas are read
// while a quiesce waits on them.
const quiesceRowPoll = 50 * time.Millisecond

// holdTraffic quiesces sandbox id, whose move this replica has marked,
// for at most bound (see above). It reports how long it waited and what
// was still open at the end ("" when nothing).
func (s *Service) holdTraffic(ctx context.Context, id string, bound time.Duration) (time.Duration, string) {
	began := time.Now()
	watchers := s.routes.hub.watchers()
	var before map[string]time.Time // other replicas' fresh rows: replica -> written at
	if s.shared() {
		before = map[string]time.Time{}
		rows, err := s.cat.ActivityOf(ctx, id)
		if err != nil {
			s.log.Warn("quiesce: read the other replicas' traffic", "sandbox_id", id, "err", err)
		}
		for _, r := range rows {
			if r.Replica != s.lead.replica && began.Sub(r.At) <= openStale {
				before[r.Replica] = r.At
			}
		}
	}
	s.routes.quiesce(id)
	if bound <= 0 {
		return 0, ""
	}
	deadline := time.NewTimer(bound)
	defer deadline.Stop()
	var lastRows time.Time
	for {
		s.activity.mu.Lock()
		changed := s.activity.changed
		pending := s.activity.pendingQuiesce(id, watchers, began, time.Now())
		s.activity.mu.Unlock()
		wake := (<-chan time.Time)(nil)
		if pending == "" && before != nil {
			if wait := quiesceRowPoll - time.Since(lastRows); wait > 0 {
				pending = "the other replicas' traffic rows"
				wake = time.After(wait)
			} else {
				lastRows = time.Now()
				pending = s.remotePending(ctx, id, before)
				if pending != "" {
					wake = time.After(quiesceRowPoll)
				}
			}
		}
		if pending == "" {
			took := time.Since(began)
			s.log.Info("quiesce: no request in flight; the sandbox freezes", "sandbox_id", id, "waited", took, "proxies", len(watchers))
			return took, ""
		}
		select {
		case <-ctx.Done():
			return time.Since(began), pending
		case <-deadline.C:
			took := time.Since(began)
			s.log.Warn("quiesce: requests still in flight at the bound; the sandbox freezes with them", "sandbox_id", id,
				"waited", took, "open", pending)
			return took, pending
		case <-changed:
		case <-wake:
		}
	}
}

// pendingQuiesce says (a.mu held) what a quiesce of id begun at began
// still waits for among the proxies reporting here: a watcher that has not
// answered, or a proxy with requests open. "" when nothing.
func (a *activity) pendingQuiesce(id string, watchers map[string]bool, began, now time.Time) string {
	var out []string
	counts := a.open[id]
	for p := range watchers {
		c, ok := counts[p]
		if !ok || c.quiesced.Before(began) {
			out = append(out, fmt.Sprintf("proxy %s: no answer", p))
		}
	}
	for p, c := range counts {
		if c.n > 0 && now.Sub(c.at) <= openStale && (!watchers[p] || !c.quiesced.Before(began)) {
			out = append(out, fmt.Sprintf("proxy %s: %d open", p, c.n))
		}
	}
	sort.Strings(out)
	return strings.Join(out, "; ")
}

// remotePending says what a quiesce of id still waits for among the
// other replicas (before: those that wrote traffic rows for it recently,
// and when): one whose row was not written again since, or any with
// requests open. "" when nothing.
func (s *Service) remotePending(ctx context.Context, id string, before map[string]time.Time) string {
	rows, err := s.cat.ActivityOf(ctx, id)
	if err != nil {
		return fmt.Sprintf("the other replicas' traffic rows: %v", err)
	}
	now := time.Now()
	var out []string
	answered := map[string]bool{}
	for _, r := range rows {
		if r.Replica == s.lead.replica {
			continue
		}
		if at, ok := before[r.Replica]; ok && r.At.After(at) {
			answered[r.Replica] = true
		}
		if r.Open > 0 && now.Sub(r.At) <= openStale {
			out = append(out, fmt.Sprintf("replica %s: %d open", r.Replica, r.Open))
		}
	}
	for r := range before {
		if !answered[r] {
			out = append(out, fmt.Sprintf("replica %s: no answer", r))
		}
	}
	sort.Strings(out)
	return strings.Join(out, "; ")
}

// movingElsewhere reports whether another replica holds the lease of a
// move of sandbox id.
func (s *Service) movingElsewhere(ctx context.Context, id string) bool {
	l, held, err := s.cat.LeaseHeld(ctx, moveLeaseName(id))
	return err == nil && held && l.Holder != s.lead.holder
}
