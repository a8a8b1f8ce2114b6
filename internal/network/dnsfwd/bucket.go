package dnsfwd

import (
	"sync"
	"time"
)

// bucket is a token bucket: rate tokens per second, at most burst held.
// A rate of 0 means unlimited.
type bucket struct {
	mu       sync.Mutex
	rate     float64
	burst    float64
	tokens   float64
	last     time.Time
	lastWarn time.Time
}

func newBucket(rate float64, burst int) *bucket {
	b := float64(max(burst, 1))
	return &bucket{rate: rate, burst: b, tokens: b}
}

// take spends one token if there is one.
func (b *bucket) take(now time.Time) bool {
	if b.rate <= 0 {
		return true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.last.IsZero() {
		b.tokens = min(b.burst, b.tokens+now.Sub(b.last).Seconds()*b.rate)
	}
	b.last = now
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}

// warn reports whether a limited query should be logged: at most once a
// second per sandbox, so the limit also bounds the log.
func (b *bucket) warn(now time.Time) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if now.Sub(b.lastWarn) < time.Second {
		return false
	}
	b.lastWarn = now
	return true
}
