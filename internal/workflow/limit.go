package workflow

import (
	"context"
	"sync"
	"time"
)

// limiter is a counting semaphore whose limit can change while runs hold
// it; a run over the limit waits for a slot at most its flow's queue time.
// One limiter per flow name lives for the engine's lifetime, so in-flight
// counts survive Reload.
type limiter struct {
	mu       sync.Mutex
	limit    int // 0 = unlimited
	inflight int
	// freed is closed (and cleared) when a slot frees or the limit
	// changes: waiters look again.
	freed chan struct{}
}

// tryAcquire takes a slot if one is free; it never waits.
func (l *limiter) tryAcquire() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.limit > 0 && l.inflight >= l.limit {
		return false
	}
	l.inflight++
	return true
}

// acquire takes a slot, waiting up to wait for one to free (not in
// arrival order: a brief queue, not a fair one). It reports false when
// none freed in time or ctx ended.
func (l *limiter) acquire(ctx context.Context, wait time.Duration) bool {
	if l.tryAcquire() {
		return true
	}
	if wait <= 0 {
		return false
	}
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for {
		l.mu.Lock()
		if l.limit == 0 || l.inflight < l.limit {
			l.inflight++
			l.mu.Unlock()
			return true
		}
		if l.freed == nil {
			l.freed = make(chan struct{})
		}
		freed := l.freed
		l.mu.Unlock()
		select {
		case <-freed:
		case <-timer.C:
			return false
		case <-ctx.Done():
			return false
		}
	}
}

// wake tells waiters to look again. Caller holds mu.
func (l *limiter) wake() {
	if l.freed != nil {
		close(l.freed)
		l.freed = nil
	}
}

func (l *limiter) release() {
	l.mu.Lock()
	l.inflight--
	l.wake()
	l.mu.Unlock()
}

func (l *limiter) setLimit(n int) {
	l.mu.Lock()
	l.limit = n
	l.wake()
	l.mu.Unlock()
}

func (l *limiter) state() FlowLimit {
	l.mu.Lock()
	defer l.mu.Unlock()
	return FlowLimit{Limit: l.limit, InFlight: l.inflight}
}

// FlowLimit is a flow's concurrency limit (0 = unlimited) and how many runs
// hold it now. InFlight may exceed Limit right after a limit is lowered.
type FlowLimit struct {
	Limit    int
	InFlight int
}
