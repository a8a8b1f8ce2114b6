package workflow

import "sync"

// limiter is a non-blocking counting semaphore whose limit can change while
// runs hold it. One limiter per flow name lives for the engine's lifetime, so
// in-flight counts survive Reload.
type limiter struct {
	mu       sync.Mutex
	limit    int // 0 = unlimited
	inflight int
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

func (l *limiter) release() {
	l.mu.Lock()
	l.inflight--
	l.mu.Unlock()
}

func (l *limiter) setLimit(n int) {
	l.mu.Lock()
	l.limit = n
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
