package opsapi

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"
)

// TestJobsEndAtShutdown: a running job (a drain waiting on its node) is
// cancelled when the master shuts down, and says so. The control is a
// job of a handler whose master keeps running: it is still running when
// the first one has ended.
func TestJobsEndAtShutdown(t *testing.T) {
	done := make(chan struct{})
	h := New(nil, Config{Done: done}, nil)
	control := New(nil, Config{Done: make(chan struct{})}, nil)
	wait := func(ctx context.Context, _ *job) error { <-ctx.Done(); return ctx.Err() }
	r := httptest.NewRequest("POST", "/nodes/n1/drain", nil)
	jb := h.start(r, "drain", "n1", wait)
	cj := control.start(r, "drain", "n1", wait)
	t.Cleanup(func() { cj.cancel() })
	close(done)
	deadline := time.Now().Add(5 * time.Second)
	for {
		jb.mu.Lock()
		st := jb.j.State
		jb.mu.Unlock()
		if st == jobCancelled {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("job is %q 5 s after the shutdown, want %q", st, jobCancelled)
		}
		time.Sleep(5 * time.Millisecond)
	}
	h.Wait() // returns: the shut-down master's job has ended
	cj.mu.Lock()
	defer cj.mu.Unlock()
	if cj.j.State != jobRunning {
		t.Fatalf("control: the other master's job is %q, want %q", cj.j.State, jobRunning)
	}
}

// TestStreamsPerCaller: a caller gets maxStreamsPerCaller live streams and
// a 429 for the next one, while another caller still gets one (the
// control); a closed stream frees its place.
func TestStreamsPerCaller(t *testing.T) {
	h := New(nil, Config{}, nil)
	as := func(user string) *http.Request {
		r := httptest.NewRequest("GET", "/live", nil)
		return r.WithContext(context.WithValue(r.Context(), callerKey{}, &caller{user: user}))
	}
	var closers []func()
	for range maxStreamsPerCaller {
		done, ok := h.openStream(httptest.NewRecorder(), as("alice"))
		if !ok {
			t.Fatal("a stream under the bound refused")
		}
		closers = append(closers, done)
	}
	w := httptest.NewRecorder()
	if _, ok := h.openStream(w, as("alice")); ok || w.Code != http.StatusTooManyRequests {
		t.Fatalf("stream %d: ok=%v code=%d, want 429", maxStreamsPerCaller+1, ok, w.Code)
	}
	done, ok := h.openStream(httptest.NewRecorder(), as("bob"))
	if !ok {
		t.Fatal("control: another caller's first stream refused")
	}
	done()
	closers[0]()
	if _, ok := h.openStream(httptest.NewRecorder(), as("alice")); !ok {
		t.Fatal("a stream after one closed refused")
	}
}
