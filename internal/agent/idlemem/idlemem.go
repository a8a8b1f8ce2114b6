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
// flight for a quiet period (DefaultIdle in the agent), collects and
// returns free pages (debug.FreeOSMemory),
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
	stopped  bool
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

// Stop ends the releaser: no release follows.
func (r *Releaser) Stop() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.stopped = true
	r.timer.Stop()
}

func (r *Releaser) armLocked() {
	if r.stopped {
		return
	}
	r.due = r.now().Add(r.idle)
	r.timer.Reset(r.idle)
}

// lateBy is how late a timer may fire before fire takes the process to
// have been stopped meanwhile.
const lateBy = 2 * time.Second

// fire runs when the quiet period is over. A timer more than lateBy late
// means the process was stopped meanwhile (a paused runc sandbox thawed,
// a warm-pool entry claimed, a snapshot restored): whatever woke it is
// about to use it, and a collection now would delay exactly that, so the
// quiet period starts over instead. (A VM's guest clock stops with the
// guest, so there the timer is never late: a release may follow a resume
// at once, if one was due.) After a release it checks once more a quiet
// period later: with no request in flight the agent may still allocate,
// copying a detached process's output into the sandbox's log.
func (r *Releaser) fire() {
	r.mu.Lock()
	now := r.now()
	switch {
	case r.stopped || r.active > 0 || now.Before(r.due):
		// A request began since the timer was set, or one began and
		// ended while this call waited for the lock and set a new due.
		r.mu.Unlock()
		return
	case now.Sub(r.due) > lateBy:
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
	if r.active == 0 {
		r.armLocked()
	}
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
