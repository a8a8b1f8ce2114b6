package master

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"sync"
	"time"

	"github.com/cubesandbox/cube/internal/master/catalog"
)

// loopsLease names the lease under which the lifecycle loops run.
const loopsLease = "master-loops"

// leader runs the singleton loops while this replica holds the loops'
// lease in the catalog. With one replica (SQLite, or the only master of a
// MySQL catalog) it holds the lease from start to stop.
//
// Safety: the lease row is timed by the database's clock. A renewal sent
// at t0 (our clock) makes the row expire no earlier than t0 + ttl in real
// time, so another replica can take it no earlier than that; this replica
// stops its loops, and waits for them to return, by t0 + ttl - ttl/4
// unless a later renewal succeeded. Actions with effects outside the
// catalog also check the lease (fence) right before acting.
type leader struct {
	s        *Service
	replica  string
	holder   string // this process: replica ID and a random suffix
	ttl      time.Duration
	loops    []func(ctx context.Context)
	mu       sync.Mutex
	token    int64 // while held
	held     bool
	cancel   context.CancelFunc
	loopCtx  context.Context // while held
	wg       sync.WaitGroup
	acquired chan struct{} // closed on the first acquisition (tests, start-up)
	once     sync.Once
}

type leaseTokenKey struct{}

func newLeader(s *Service, loops ...func(ctx context.Context)) *leader {
	replica := s.cfg.HA.ReplicaID
	if replica == "" {
		replica, _ = os.Hostname()
		if replica == "" {
			replica = "cubemaster"
		}
	}
	var b [6]byte
	_, _ = rand.Read(b[:])
	return &leader{
		s: s, replica: replica, holder: replica + "#" + hex.EncodeToString(b[:]),
		ttl: s.cfg.HA.LeaseTTL.Duration, loops: loops, acquired: make(chan struct{}),
	}
}

// run campaigns for the lease and renews it until ctx ends, starting the
// loops when it is won and stopping them when it is lost or may lapse.
// At the end it stops the loops and releases the lease so another
// replica takes over at once.
func (l *leader) run(ctx context.Context) {
	renew := l.ttl / 3
	margin := l.ttl / 4
	var validUntil time.Time
	// Until the catalog first answers, this process may take over the
	// lease of an earlier process of its replica; never after, so two
	// processes wrongly given one replica ID do not both keep renewing.
	takeOwn := true
	for {
		t0 := time.Now()
		// A renewal never runs past the point where the loops must have
		// stopped: a catalog that holds the request without answering
		// (a partition) would otherwise keep the loops running until the
		// request times out, after another replica may hold the lease.
		timeout := renew
		if l.isHeld() {
			timeout = min(timeout, time.Until(validUntil))
			if timeout <= 0 {
				l.s.log.Warn("lease: not renewed in time; stopping the lifecycle loops", "lease", loopsLease)
				l.stop()
				continue
			}
		}
		actx, cancel := context.WithTimeout(ctx, timeout)
		var prev catalog.Lease
		if takeOwn {
			prev, _ = l.s.cat.GetLease(actx, loopsLease)
		}
		lease, ok, err := l.s.cat.AcquireLease(actx, loopsLease, l.holder, l.replica, l.ttl, takeOwn)
		cancel()
		if err == nil {
			takeOwn = false
		}
		wait := renew
		switch {
		case ctx.Err() != nil:
		case err != nil:
			l.s.log.Warn("lease: renew failed", "lease", loopsLease, "err", err, "held", l.isHeld())
			wait = min(renew, 200*time.Millisecond)
		case ok:
			if prev.Replica == l.replica && prev.Holder != "" && prev.Holder != l.holder && prev.ExpiresAt.After(time.Now()) {
				l.s.log.Warn("lease: taken over from an earlier process of this replica; if that process still runs, two replicas share ha.replica_id",
					"lease", loopsLease, "previous_holder", prev.Holder)
			}
			validUntil = t0.Add(l.ttl - margin)
			l.start(ctx, lease.Token)
		case l.isHeld():
			l.s.log.Warn("lease: taken by another replica; stopping the lifecycle loops", "lease", loopsLease, "holder", lease.Holder, "token", lease.Token)
			l.stop()
		}
		var lapse <-chan time.Time
		if l.isHeld() {
			left := time.Until(validUntil)
			if left <= 0 {
				l.s.log.Warn("lease: not renewed in time; stopping the lifecycle loops", "lease", loopsLease)
				l.stop()
				continue
			}
			lapse = time.After(left)
		}
		select {
		case <-ctx.Done():
			l.stop()
			rctx, rcancel := context.WithTimeout(context.Background(), 2*time.Second)
			if err := l.s.cat.ReleaseLease(rctx, loopsLease, l.holder); err != nil {
				l.s.log.Warn("lease: release", "err", err)
			}
			rcancel()
			return
		case <-time.After(wait - time.Since(t0)):
		case <-lapse:
			l.s.log.Warn("lease: not renewed in time; stopping the lifecycle loops", "lease", loopsLease)
			l.stop()
		}
	}
}

// start runs the loops unless they run already.
func (l *leader) start(ctx context.Context, token int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.held {
		return
	}
	lctx, cancel := context.WithCancel(context.WithValue(ctx, leaseTokenKey{}, token))
	l.held, l.token, l.cancel, l.loopCtx = true, token, cancel, lctx
	l.s.log.Info("lease: acquired; running the lifecycle loops", "lease", loopsLease, "holder", l.holder, "token", token)
	for _, fn := range l.loops {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			fn(lctx)
		}()
	}
	l.once.Do(func() { close(l.acquired) })
}

// stop ends the loops and waits for them.
func (l *leader) stop() {
	l.mu.Lock()
	if !l.held {
		l.mu.Unlock()
		return
	}
	l.held = false
	l.cancel()
	l.mu.Unlock()
	l.wg.Wait()
	l.s.log.Info("lease: lifecycle loops stopped", "lease", loopsLease, "holder", l.holder)
}

func (l *leader) isHeld() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.held
}

// goLoop runs fn in the loops' context while the lease is held, and
// returns false (running nothing) otherwise. fn ends when the lease is
// lost.
func (l *leader) goLoop(fn func(ctx context.Context)) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.held {
		return false
	}
	ctx := l.loopCtx
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		fn(ctx)
	}()
	return true
}

// Lease is this replica's view of the loops' lease: whether it holds it,
// with which fencing token, and its holder name.
func (s *Service) Lease() (held bool, token int64, holder string) {
	l := s.lead
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.held, l.token, l.holder
}

// fence is the fencing check of singleton actions: run under the loops'
// lease (ctx carries its token), an action with effects outside the
// catalog first checks in the catalog that the lease is still this
// process's with that token. Calls not made by a loop (API verbs) pass.
func (s *Service) fence(ctx context.Context) error {
	token, ok := ctx.Value(leaseTokenKey{}).(int64)
	if !ok {
		return nil
	}
	return s.cat.CheckLease(ctx, loopsLease, s.lead.holder, token)
}
