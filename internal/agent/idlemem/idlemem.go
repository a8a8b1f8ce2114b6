// Package idlemem gives an agent that has gone quiet its free memory back
// to the kernel.
//
// The agent's heap is small (tens of KiB live) but the Go runtime lets
// garbage pile up to its heap goal (4 MiB at GOGC=100) before it collects,
// and keeps what it collected for reuse: an agent that served a few
// thousand requests and then sat idle held ~6 MiB of anonymous memory
// against ~1.2 MiB fresh, and kept it. Worse, a runtime that never
// collected never collects when idle either: its two-minute forced
// collection only runs once some collection has. For a node with
// thousands of idle sandboxes that is most of their memory.
//
// A Releaser watches the agent's requests and, once none has been in
// flight for Idle, collects and returns free pages (debug.FreeOSMemory),
// when enough was allocated since the last release to be worth it: a
// first collection costs its own metadata (~0.4 MiB), more than a fresh
// agent's garbage. A release is at most one per quiet period and costs a
// few milliseconds of CPU; the next request faults the pages it needs
// back in.
package idlemem

import (
	"net/http"
	"runtime/debug"
	"runtime/metrics"
	"sync"
	"time"
)

// Defaults for the agent.
const (
	// DefaultIdle is the quiet time before a release: longer than the
	// gaps in a conversation with the sandbox (an agent's model thinking
	// between commands), short next to how long idle sandboxes sit.
	DefaultIdle = 30 * time.Second
	// DefaultMin is what must have been allocated since the last release:
	// below it, the garbage is smaller than what a collection's own
	// metadata adds.
	DefaultMin = 2 << 20
)

// allocsMetric counts every byte the heap ever allocated.
const allocsMetric = "/gc/heap/allocs:bytes"

// Releaser returns free memory after a quiet period. The zero value is not
// usable; use New.
type Releaser struct {
	idle time.Duration
	min  uint64

	// For tests: the clock, what a release does and the allocation count.
	now     func() time.Time
	release func()
	allocs  func() uint64

	mu       sync.Mutex
	active   int
	timer    *time.Timer
	due      time.Time
	last     uint64 // allocs after the last release
	releases int
}

// New returns a Releaser that releases after idle without requests, when
// at least minAlloc bytes were allocated since the last release.
func New(idle time.Duration, minAlloc uint64) *Releaser {
	r := &Releaser{idle: idle, min: minAlloc, now: time.Now, release: debug.FreeOSMemory, allocs: heapAllocs}
	r.timer = time.AfterFunc(time.Hour, r.fire)
	r.timer.Stop()
	return r
}

// Wrap counts h's requests in flight: the quiet period starts when the
// last one ends. A stream (process output, a watch) is a request in
// flight for as long as it is open.
func (r *Releaser) Wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		r.begin()
		defer r.end()
		h.ServeHTTP(w, req)
	})
}

// Releases counts the releases so far.
func (r *Releaser) Releases() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.releases
}

func (r *Releaser) begin() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.active++
	r.timer.Stop()
}

func (r *Releaser) end() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.active--
	if r.active == 0 {
		r.armLocked()
	}
}

func (r *Releaser) armLocked() {
	r.due = r.now().Add(r.idle)
	r.timer.Reset(r.idle)
}

// fire runs when the quiet period is over. A timer that fires long after
// it was due means the process was stopped meanwhile (a paused sandbox
// thawed, a warm-pool entry claimed, a snapshot restored): whatever woke
// it is about to use it, and a collection now would delay exactly that,
// so the quiet period starts over instead.
func (r *Releaser) fire() {
	r.mu.Lock()
	if r.active > 0 {
		r.mu.Unlock()
		return
	}
	if late := r.now().Sub(r.due); late > r.idle/2 {
		r.armLocked()
		r.mu.Unlock()
		return
	}
	last := r.last
	r.mu.Unlock()
	if r.allocs()-last < r.min {
		return
	}
	r.release()
	after := r.allocs()
	r.mu.Lock()
	r.last = after
	r.releases++
	r.mu.Unlock()
}

func heapAllocs() uint64 {
	s := []metrics.Sample{{Name: allocsMetric}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindUint64 {
		return 0
	}
	return s[0].Value.Uint64()
}
