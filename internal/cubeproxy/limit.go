package cubeproxy

import (
	"net/netip"
	"sync"
	"time"
)

// unknownLimit bounds what one client may cost by naming sandboxes that
// do not exist: each such request takes a token from the client's bucket
// (unknownBurst, refilled at unknownRate a second); with the bucket empty
// the client's requests for sandboxes this replica has no route cached
// for are answered 429 without asking the master. Requests for cached
// routes (sandboxes the replica served recently) always pass, so a client
// that also probes random IDs keeps reaching its own sandboxes.
//
// Clients are told apart by source IPv4 address or IPv6 /64 (the
// smallest prefix a site is given: keying per IPv6 address would give one
// client 2^64 buckets). Behind a load balancer that does not keep the
// source, every client shares one bucket for unknown IDs.
type unknownLimit struct {
	mu      sync.Mutex
	buckets map[string]*bucket
}

const (
	unknownRate  = 20.0 // tokens a second
	unknownBurst = 100.0
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

func newUnknownLimit() *unknownLimit { return &unknownLimit{buckets: map[string]*bucket{}} }

// clientOf is the bucket key of a request's remote address: its IPv4
// address (IPv4-mapped IPv6 included) or its IPv6 /64.
func clientOf(remoteAddr string) string {
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
func (b *bucket) refill(now time.Time) {
	b.tokens = min(unknownBurst, b.tokens+now.Sub(b.at).Seconds()*unknownRate)
	b.at = now
}

// exhausted reports whether client has no token left.
func (l *unknownLimit) exhausted(client string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	b := l.buckets[client]
	if b == nil {
		return false
	}
	b.refill(time.Now())
	return b.tokens < 1
}

// miss takes a token from client's bucket: it asked for a sandbox that
// does not exist.
func (l *unknownLimit) miss(client string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := time.Now()
	b := l.buckets[client]
	if b == nil {
		if len(l.buckets) >= maxClients {
			l.evict(now)
		}
		b = &bucket{tokens: unknownBurst, at: now}
		l.buckets[client] = b
	}
	b.refill(now)
	b.tokens = max(0, b.tokens-1)
}

// evict makes room. Caller holds mu.
func (l *unknownLimit) evict(now time.Time) {
	for k, b := range l.buckets {
		if b.refill(now); b.tokens >= unknownBurst {
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
