package master

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/cubesandbox/cube/internal/master/catalog"
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
//     sandbox within quiesceAnswerFrom before the hold has answered in its
//     traffic row (the move lease's token, written once every proxy
//     watching that replica answered; then again on each change of what
//     they have open) with nothing open. The answer names the hold by
//     the lease's token, which each move raises (a move releases its
//     lease, keeping the row and its token; moveLeaseKeep), so an answer
//     to an earlier move never counts for a later one. The wait is
//     bounded by [drain] request_wait (at most MaxRequestWait); past it
//     the sandbox freezes with what is left open, which the proxies'
//     rules for a cut request handle (docs/proxy.md).
//  3. Freeze: the move goes on (pause, snapshot, ...).
//
// A sandbox with nothing in flight costs one round trip to each watching
// proxy (and, on a shared catalog, one read of its traffic rows, plus
// one route poll and write of each replica that served it recently).

// quiesceAnswerFrom: a quiesce waits for the answer of every other
// replica that wrote a traffic row for the sandbox this recently. One of
// its proxies may still hold the sandbox's route in its cache (30 s after
// the request that resolved it, which the replica wrote down within
// activityFlush).
const quiesceAnswerFrom = 30*time.Second + activityFlush + 4*time.Second

// quiesceRowPoll is how often the traffic rows of other replicas are read
// while a quiesce waits on them.
const quiesceRowPoll = 50 * time.Millisecond

// holdTraffic quiesces sandbox id, whose move this replica has marked,
// for at most bound (see above). It reports how long it waited and what
// was still open at the end ("" when nothing).
func (s *Service) holdTraffic(ctx context.Context, id string, bound time.Duration) (time.Duration, string) {
	began := time.Now()
	watchers := s.routes.hub.watchers()
	var before map[string]bool // other replicas that served it recently
	var token int64            // the move's lease token, which they answer with
	if m, ok := s.moving.Load(id); ok && s.shared() {
		token = m.(*moveMark).token
		before = map[string]bool{}
		rows, err := s.cat.ActivityOf(ctx, id)
		if err != nil {
			s.log.Warn("quiesce: read the other replicas' traffic", "sandbox_id", id, "err", err)
		}
		for _, r := range rows {
			if r.Replica != s.lead.replica && began.Sub(r.At) <= quiesceAnswerFrom {
				before[r.Replica] = true
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
		// A proxy that stopped watching (its stream broke, it is gone)
		// cannot answer; it dropped its whole cache, and what it still
		// has open counts through its reports.
		current := s.routes.hub.watchers()
		for p := range watchers {
			if !current[p] {
				delete(watchers, p)
			}
		}
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
				pending = s.remotePending(ctx, id, before, token)
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

// remotePending says what a quiesce of id (under the move lease's token)
// still waits for among the other replicas (before: those that wrote
// traffic rows for it recently): one that has not answered, or any with
// requests open. "" when nothing.
func (s *Service) remotePending(ctx context.Context, id string, before map[string]bool, token int64) string {
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
		if r.QuiesceToken == token {
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

// quiesceAnswer is this replica's part in another replica's quiesce of a
// sandbox: the proxies watching when the quiesce event arrived, which
// must answer before the traffic row carries the token.
type quiesceAnswer struct {
	token    int64
	watchers map[string]bool
	began    time.Time
}

// MaxRequestWait bounds [drain] request_wait and a drain's own request
// wait: a quiesce on a shared catalog reads the other replicas' answers,
// which they keep for quiesceAnswerKeep from the quiesce's start.
const MaxRequestWait = time.Minute

// quiesceAnswerKeep bounds how long a quiesce by another replica holds
// this replica's traffic row for its proxies' answers (and then carries
// its token): as long as any request_wait the mover may use.
const quiesceAnswerKeep = MaxRequestWait

// answerQuiesce passes another replica's quiesce of sandbox id (its move
// lease's token) on to the proxies watching this one; the traffic row
// answers once they have (activity.quiesceToken).
func (s *Service) answerQuiesce(id string, token int64) {
	a := s.activity
	q := &quiesceAnswer{token: token, watchers: s.routes.hub.watchers(), began: time.Now()}
	a.mu.Lock()
	a.quiescing[id] = q
	a.dirty[id] = true
	a.mu.Unlock()
	s.routes.dropLocal(id, true)
	a.kickFlush()
}

// quiesceToken (a.mu held) is the token id's traffic row carries now, and
// whether the row may be written: not while a quiesce by another replica
// waits for this replica's proxies to answer. current holds the proxies
// watching now: one that stopped (its stream broke, it is gone) cannot
// answer; it dropped its whole cache, and what it still has open counts
// through its reports (as in holdTraffic).
func (a *activity) quiesceToken(id string, current map[string]bool, now time.Time) (int64, bool) {
	q := a.quiescing[id]
	if q == nil {
		return 0, true
	}
	if now.Sub(q.began) > quiesceAnswerKeep {
		delete(a.quiescing, id)
		return 0, true
	}
	for p := range q.watchers {
		if !current[p] {
			continue
		}
		if c, ok := a.open[id][p]; !ok || c.quiesced.Before(q.began) {
			return 0, false
		}
	}
	return q.token, true
}

// movingElsewhere gives, for the sandboxes of evs that another replica
// is moving, the token of that move's lease (one catalog read for all of
// them). When the read fails none counts as moving: the routes are
// dropped, which a mover's retry of its quiesce survives.
func (s *Service) movingElsewhere(ctx context.Context, evs []catalog.RouteEvent) map[string]int64 {
	if len(evs) == 0 {
		return nil
	}
	byLease := make(map[string]string, len(evs))
	names := make([]string, 0, len(evs))
	for _, e := range evs {
		n := moveLeaseName(e.SandboxID)
		if _, ok := byLease[n]; !ok {
			byLease[n] = e.SandboxID
			names = append(names, n)
		}
	}
	held, err := s.cat.HeldLeases(ctx, names)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Warn("routes: read the move leases", "err", err)
		}
		return nil
	}
	moving := map[string]int64{}
	for n, l := range held {
		if l.Holder != s.lead.holder {
			moving[byLease[n]] = l.Token
		}
	}
	return moving
}

// pruneQuiescing (a.mu held) forgets the quiesces by other replicas
// older than quiesceAnswerKeep that no traffic row write took up.
func (a *activity) pruneQuiescing(now time.Time) {
	for id, q := range a.quiescing {
		if now.Sub(q.began) > quiesceAnswerKeep {
			delete(a.quiescing, id)
		}
	}
}
