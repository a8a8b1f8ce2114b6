// Package clientlimit bounds what one network client may cost a listener
// by failing: a token bucket per client, taken from by each failed
// request (an unknown sandbox ID, a refused join token), so that a client
// with an empty bucket is refused before the listener does the work a
// failure costs. Clients are told apart by source IPv4 address or IPv6 /64
// (the smallest prefix a site is given: keying per IPv6 address would give
// one client 2^64 buckets). Behind a load balancer that does not keep the
// source, every client shares one bucket.
package clientlimit

import (
	"net/netip"
	"sync"
	"time"
)

// Limiter holds one bucket per client: burst tokens, refilled at rate a
// second.
type Limiter struct {
	rate, burst float64
	mu          sync.Mutex
	buckets     map[string]*bucket
}

const (
	// maxClients bounds the table; when full, buckets that have refilled
	// (they limit nothing) are dropped, then any, down to evictTo, so a
	// stream of new clients costs one scan per maxClients-evictTo of
	// them, not one each.
	maxClients = 65536
	evictTo    = maxClients * 7 / 8
)

type bucket struct {
	tokens float64
	at     time.Time
}

// New returns a limiter of burst failures per client, refilled at rate a
// second.
func New(rate, burst float64) *Limiter {
	return &Limiter{rate: rate, burst: burst, buckets: map[string]*bucket{}}
}

// ClientOf is the client of a request's remote address (host:port): its
// IPv4 address (IPv4-mapped IPv6 included) or its IPv6 /64.
func ClientOf(remoteAddr string) string {
	ap, err := netip.ParseAddrPort(remoteAddr)
	if err != nil {
		return remoteAddr
	}
	a := ap.Addr().Unmap()
	if a.Is4() {
		return a.String()
	}
	p, err := a.WithZone("").Prefix(64)
	if err != nil {
		return a.String()
	}
	return p.String()
}

// refill brings b up to now. Caller holds mu.
func (l *Limiter) refill(b *bucket, now time.Time) {
	b.tokens = min(l.burst, b.tokens+now.Sub(b.at).Seconds()*l.rate)
	b.at = now
}

// Exhausted reports whether client has no token left.
func (l *Limiter) Exhausted(client string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	b := l.buckets[client]
	if b == nil {
		return false
	}
	l.refill(b, time.Now())
	return b.tokens < 1
}

// Fail takes a token from client's bucket: a request of its failed.
func (l *Limiter) Fail(client string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := time.Now()
	b := l.buckets[client]
	if b == nil {
		if len(l.buckets) >= maxClients {
			l.evict(now)
		}
		b = &bucket{tokens: l.burst, at: now}
		l.buckets[client] = b
	}
	l.refill(b, now)
	b.tokens = max(0, b.tokens-1)
}

// evict makes room. Caller holds mu.
func (l *Limiter) evict(now time.Time) {
	for k, b := range l.buckets {
		if l.refill(b, now); b.tokens >= l.burst {
			delete(l.buckets, k)
		}
	}
	for k := range l.buckets {
		if len(l.buckets) <= evictTo {
			return
		}
		delete(l.buckets, k)
	}
}

// Take takes a token from client's bucket before the request is served,
// and reports false (taking nothing) when there is none: concurrent
// requests of one client cannot all pass a check made before any of them
// failed. A request that then succeeds gives its token back (Refund).
func (l *Limiter) Take(client string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := time.Now()
	b := l.buckets[client]
	if b == nil {
		if len(l.buckets) >= maxClients {
			l.evict(now)
		}
		b = &bucket{tokens: l.burst, at: now}
		l.buckets[client] = b
	}
	l.refill(b, now)
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}

// Refund gives back the token a successful request took.
func (l *Limiter) Refund(client string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if b := l.buckets[client]; b != nil {
		l.refill(b, time.Now())
		b.tokens = min(l.burst, b.tokens+1)
	}
}
