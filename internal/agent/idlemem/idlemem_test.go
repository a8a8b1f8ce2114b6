package idlemem

import (
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

var sink [][]byte

// garbage allocates n bytes in page-sized objects, writes to each (fresh
// pages the runtime hands out untouched are not resident) and drops them.
func garbage(n int) {
	for i := 0; i < n/4096; i++ {
		b := make([]byte, 4096)
		b[0], b[2048] = 1, 1
		sink = append(sink, b)
		if len(sink) == 256 {
			sink = nil
		}
	}
	sink = nil
}

// rssAnon is this process's resident anonymous memory.
func rssAnon(t *testing.T) uint64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "RssAnon:"); ok {
			kb, err := strconv.ParseUint(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
	}
	t.Fatal("no RssAnon in /proc/self/status")
	return 0
}

func serve(t *testing.T, h http.Handler) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/health", nil))
	if rec.Code != http.StatusOK {
		t.Fatalf("request: %d", rec.Code)
	}
}

func ok(w http.ResponseWriter, _ *http.Request) {}

func waitReleases(t *testing.T, r *Releaser, want int, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for r.Releases() < want {
		if time.Now().After(deadline) {
			t.Fatalf("releases: %d, want %d", r.Releases(), want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestReleaseAfterQuiet: garbage made while serving goes back to the
// kernel once no request has been in flight for the quiet period; the
// same garbage stays resident without the release (control).
func TestReleaseAfterQuiet(t *testing.T) {
	// Under load the runtime's background scavenger returns a good part
	// of the control's garbage on its own: a few tries.
	var freed [2]int64
	for try := 0; try < 3; try++ {
		for i, release := range []bool{false, true} {
			r := New(50*time.Millisecond, 4<<20)
			t.Cleanup(r.Stop)
			if !release {
				r.release = func() {}
			}
			h := r.Wrap(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) { garbage(32 << 20) }))
			serve(t, h)
			before := rssAnon(t)
			waitReleases(t, r, 1, 5*time.Second)
			after := rssAnon(t)
			r.Stop()
			t.Logf("release %v: anonymous memory %d KiB -> %d KiB", release, before>>10, after>>10)
			freed[i] = int64(before) - int64(after)
		}
		if freed[1] >= freed[0]+2<<20 {
			return
		}
	}
	t.Errorf("anonymous memory fell by %d KiB with the release, %d KiB without; want 2 MiB more with it", freed[1]>>10, freed[0]>>10)
}

// TestReleaseEachQuietPeriod: every quiet period after enough allocation
// releases once; one after a request that allocated little does not.
func TestReleaseEachQuietPeriod(t *testing.T) {
	r := New(30*time.Millisecond, 4<<20)
	t.Cleanup(r.Stop)
	h := r.Wrap(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Query().Has("big") {
			garbage(16 << 20)
		}
	}))
	get := func(target string) {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, target, nil))
	}
	get("/?big")
	waitReleases(t, r, 1, 5*time.Second)
	get("/")
	time.Sleep(200 * time.Millisecond)
	if n := r.Releases(); n != 1 {
		t.Fatalf("releases after a quiet period with little allocated: %d, want 1", n)
	}
	get("/?big")
	waitReleases(t, r, 2, 5*time.Second)
}

// TestNoReleaseBelowMin: a quiet agent that allocated little keeps its
// pages, since a collection's own metadata would cost more; the same
// requests with a lower bound do release (control).
func TestNoReleaseBelowMin(t *testing.T) {
	for _, tc := range []struct {
		min     uint64
		release bool
	}{{1 << 40, false}, {1, true}} {
		r := New(20*time.Millisecond, tc.min)
		t.Cleanup(r.Stop)
		serve(t, r.Wrap(http.HandlerFunc(ok)))
		time.Sleep(300 * time.Millisecond)
		r.Stop()
		if n := r.Releases(); (n > 0) != tc.release {
			t.Errorf("min %d: %d releases, want some: %v", tc.min, n, tc.release)
		}
	}
}

// TestNoReleaseWhileInFlight: a request in flight (a stream) holds the
// release off however long it lasts; its end starts the quiet period.
func TestNoReleaseWhileInFlight(t *testing.T) {
	r := New(20*time.Millisecond, 1)
	t.Cleanup(r.Stop)
	hold := make(chan struct{})
	var started sync.WaitGroup
	started.Add(1)
	h := r.Wrap(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Path == "/stream" {
			started.Done()
			<-hold
		}
	}))
	serve(t, h) // arms the timer
	done := make(chan struct{})
	go func() {
		defer close(done)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/stream", nil))
	}()
	started.Wait()
	time.Sleep(200 * time.Millisecond)
	if n := r.Releases(); n != 0 {
		t.Fatalf("released %d times with a request in flight", n)
	}
	close(hold)
	<-done
	waitReleases(t, r, 1, 5*time.Second)
}

// TestLateTimerStartsOver: a timer that fires long after it was due (the
// process was frozen) starts the quiet period over instead of collecting
// while the request that woke the sandbox is served; once timers fire on
// time again it releases. The same request with a clock that never jumps
// releases at the first firing (control).
func TestLateTimerStartsOver(t *testing.T) {
	for _, late := range []bool{true, false} {
		var calls atomic.Int32
		var jumping atomic.Bool
		jumping.Store(late)
		var jumps atomic.Int64
		r := New(20*time.Millisecond, 1)
		t.Cleanup(r.Stop)
		// Every reading of a jumping clock is an hour past the one
		// before: each firing is an hour late.
		r.now = func() time.Time {
			if jumping.Load() {
				return time.Now().Add(time.Duration(jumps.Add(1)) * time.Hour)
			}
			return time.Now()
		}
		r.release = func() { calls.Add(1) }
		serve(t, r.Wrap(http.HandlerFunc(ok)))
		if !late {
			waitReleases(t, r, 1, 5*time.Second)
			continue
		}
		time.Sleep(300 * time.Millisecond)
		if n := calls.Load(); n != 0 {
			t.Fatalf("released %d times on late timers", n)
		}
		if jumps.Load() < 4 {
			t.Fatalf("clock read %d times in 300 ms: the quiet period did not start over", jumps.Load())
		}
		// The clock is right again; the request that woke the process
		// ends a quiet period that releases.
		jumping.Store(false)
		serve(t, r.Wrap(http.HandlerFunc(ok)))
		waitReleases(t, r, 1, 5*time.Second)
	}
}

// TestStaleFireDoesNotRelease: a firing that waited for the lock while a
// request began and ended (which set a new due time) does nothing; one at
// its due time releases (control).
func TestStaleFireDoesNotRelease(t *testing.T) {
	r := New(time.Hour, 1)
	t.Cleanup(r.Stop)
	var calls atomic.Int32
	r.release = func() { calls.Add(1) }
	h := r.Wrap(http.HandlerFunc(ok))
	serve(t, h)
	serve(t, h)
	r.fire()
	if n := calls.Load(); n != 0 {
		t.Fatalf("a stale firing released %d times", n)
	}
	r.mu.Lock()
	r.due = time.Now() // as if the hour were over, on time
	r.mu.Unlock()
	r.fire()
	if n := calls.Load(); n != 1 {
		t.Fatalf("a firing on time released %d times, want 1", n)
	}
}

// TestPanickingRequestEnds: a handler that panics still ends its request,
// so the quiet period starts.
func TestPanickingRequestEnds(t *testing.T) {
	r := New(20*time.Millisecond, 1)
	t.Cleanup(r.Stop)
	h := r.Wrap(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { panic(http.ErrAbortHandler) }))
	func() {
		defer func() { _ = recover() }()
		h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, "/", nil))
	}()
	waitReleases(t, r, 1, 5*time.Second)
}
