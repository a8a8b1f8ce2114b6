package master

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"time"

	"github.com/cubesandbox/cube/internal/master/catalog"
)

// What replicas of a shared catalog tell one another through it, beside
// the nodes (refreshNodes) and the loops' lease (lease.go):
//
//   - route changes: a verb on any replica drops the sandbox's route in
//     every replica's cache and in every proxy watching any replica;
//   - traffic: each replica writes the traffic it saw (proxied requests
//     its proxies reported, API verbs it served) every activityFlush, and
//     the lease's holder counts it in its idle policy.

const (
	routePoll     = 200 * time.Millisecond
	routeOverlap  = 5 * time.Second // re-read window: writers commit late
	routeKeep     = 5 * time.Minute
	activityFlush = time.Second
)

// shareRoutes records this replica's route changes for the others.
func (s *Service) shareRoutes(ctx context.Context, seen *seenSet) {
	for {
		var id string
		select {
		case <-ctx.Done():
			return
		case id = <-s.routes.share:
		}
		batch := map[string]bool{id: true}
		for more := true; more; {
			select {
			case id := <-s.routes.share:
				batch[id] = true
			default:
				more = false
			}
		}
		for id := range batch {
			ev := eventID()
			seen.add(ev)
			if err := s.cat.AddRouteEvent(ctx, ev, id); err != nil && ctx.Err() == nil {
				s.log.Warn("routes: record a change for the other replicas", "sandbox_id", id, "err", err)
			}
		}
	}
}

// followRoutes drops the routes other replicas changed, here and in the
// proxies watching this replica.
func (s *Service) followRoutes(ctx context.Context, seen *seenSet) {
	tick := time.NewTicker(routePoll)
	defer tick.Stop()
	var since int64
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		evs, now, err := s.cat.RouteEventsSince(ctx, since)
		if err != nil {
			if ctx.Err() == nil {
				s.log.Warn("routes: read the other replicas' changes", "err", err)
			}
			continue
		}
		var fresh []catalog.RouteEvent
		for _, e := range evs {
			if seen.add(e.ID) {
				fresh = append(fresh, e)
			}
		}
		moving := s.movingElsewhere(ctx, fresh)
		for _, e := range fresh {
			// A change of a sandbox that another replica is moving is
			// its quiesce (quiesce.go): the proxies watching this
			// replica report what they have open to it, and this
			// replica answers the mover in its traffic row.
			if token := moving[e.SandboxID]; token != 0 {
				s.answerQuiesce(e.SandboxID, token)
			} else {
				s.routes.dropLocal(e.SandboxID, false)
			}
		}
		since = now - routeOverlap.Milliseconds()
		seen.prune(2 * routeOverlap)
	}
}

// seenSet is the route events already acted on (ours, or read).
type seenSet struct {
	m map[string]time.Time
	c chan struct{} // a one-slot lock, so both loops may use it
}

func newSeenSet() *seenSet { return &seenSet{m: map[string]time.Time{}, c: make(chan struct{}, 1)} }

// add records id, reporting whether it is new.
func (s *seenSet) add(id string) bool {
	s.c <- struct{}{}
	defer func() { <-s.c }()
	if _, ok := s.m[id]; ok {
		return false
	}
	s.m[id] = time.Now()
	return true
}

func (s *seenSet) prune(age time.Duration) {
	s.c <- struct{}{}
	defer func() { <-s.c }()
	for id, t := range s.m {
		if time.Since(t) > age {
			delete(s.m, id)
		}
	}
}

func eventID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// flushActivity writes the traffic this replica saw for the others.
func (s *Service) flushActivity(ctx context.Context) {
	tick := time.NewTicker(activityFlush)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case <-s.activity.flush:
		}
		now := time.Now()
		a := s.activity
		watching := s.routes.hub.watchers()
		a.mu.Lock()
		var acts []catalog.Activity
		for id := range a.dirty {
			token, ok := a.quiesceToken(id, watching, now)
			if !ok {
				continue // written once the proxies answered the quiesce
			}
			var open int64
			for _, c := range a.open[id] {
				if now.Sub(c.at) <= openStale {
					open += int64(c.n)
				}
			}
			acts = append(acts, catalog.Activity{SandboxID: id, Replica: s.lead.replica, Last: a.last[id], Open: open, At: now, QuiesceToken: token})
			if open == 0 {
				delete(a.dirty, id)
			}
		}
		a.pruneQuiescing(now)
		a.mu.Unlock()
		if err := s.cat.PutActivity(ctx, acts); err != nil && ctx.Err() == nil {
			s.log.Warn("idle: record traffic for the other replicas", "err", err)
		}
	}
}

// loadActivity (the idle loop, on a shared catalog) takes in the traffic
// the other replicas wrote.
func (s *Service) loadActivity(ctx context.Context) {
	rows, err := s.cat.ListActivity(ctx)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Warn("idle: read the other replicas' traffic", "err", err)
		}
		return
	}
	now := time.Now()
	remote := map[string]remoteActivity{}
	for _, r := range rows {
		if r.Replica == s.lead.replica {
			continue
		}
		ra := remote[r.SandboxID]
		if r.Last.After(ra.last) {
			ra.last = r.Last
		}
		if r.Open > 0 && now.Sub(r.At) <= openStale {
			ra.busy = true
		}
		remote[r.SandboxID] = ra
	}
	s.activity.mu.Lock()
	s.activity.remote = remote
	s.activity.mu.Unlock()
}

// pruneShared (the lease's holder) forgets old route changes, the
// traffic rows of sandboxes gone, and the leases of moves ended long ago.
func (s *Service) pruneShared(ctx context.Context) {
	tick := time.NewTicker(time.Minute)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		if err := s.cat.PruneRouteEvents(ctx, routeKeep); err != nil && ctx.Err() == nil {
			s.log.Warn("routes: prune changes", "err", err)
		}
		if err := s.cat.PruneActivity(ctx, time.Now().Add(-time.Hour)); err != nil && ctx.Err() == nil {
			s.log.Warn("idle: prune traffic rows", "err", err)
		}
		if err := s.cat.PruneLeases(ctx, moveLeasePrefix, moveLeaseKeep); err != nil && ctx.Err() == nil {
			s.log.Warn("moves: prune the leases of moves ended", "err", err)
		}
	}
}
