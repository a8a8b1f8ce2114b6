package gvisor

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// fakeSentry serves urpc calls on a slot's control socket the way the
// sentry does, answering each with answer (nil: close without answering).
type fakeSentry struct {
	mu    sync.Mutex
	calls []string
}

func (f *fakeSentry) got() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.calls...)
}

func serveFakeSentry(t *testing.T, rid string, answer func(method string) []byte) *fakeSentry {
	t.Helper()
	l, err := net.Listen("unix", controlAddr(rid))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	f := &fakeSentry{}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			var req struct {
				Method string `json:"method"`
			}
			if json.NewDecoder(c).Decode(&req) == nil {
				f.mu.Lock()
				f.calls = append(f.calls, req.Method)
				f.mu.Unlock()
				if b := answer(req.Method); b != nil {
					_, _ = c.Write(b)
				}
			}
			c.Close()
		}
	}()
	return f
}

var (
	answerOK     = func(string) []byte { return []byte(`{"success":true,"err":"","result":{}}`) }
	answerRefuse = func(string) []byte { return []byte(`{"success":false,"err":"unknown method","result":null}`) }
	answerNone   = func(string) []byte { return nil }
)

// unitSlot writes a runsc state and lock file for a fresh slot under a
// driver of its own, with status and sandbox PID pid.
func unitSlot(t *testing.T, status string, pid int, extraSandbox string) (*Driver, string) {
	t.Helper()
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	rid := "unit-" + hex.EncodeToString(b) + "."
	d := &Driver{root: t.TempDir(), log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	state := `{"id":"` + rid + `","bundleDir":"/nonexistent","status":"` + status + `","keep":{"a":[1,2]},` +
		`"sandbox":{"pid":` + itoa(pid) + extraSandbox + `},"spec":{"linux":{"cgroupsPath":""}}}`
	if err := os.WriteFile(d.statePath(rid), []byte(state), 0o640); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(d.lockPath(rid), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	return d, rid
}

func itoa(n int) string { b, _ := json.Marshal(n); return string(b) }

func statusOf(t *testing.T, d *Driver, rid string) string {
	t.Helper()
	b, err := os.ReadFile(d.statePath(rid))
	if err != nil {
		t.Fatal(err)
	}
	var st map[string]json.RawMessage
	if err := json.Unmarshal(b, &st); err != nil {
		t.Fatal(err)
	}
	if string(st["keep"]) != `{"a":[1,2]}` {
		t.Fatalf("state file lost a field runsc wrote: %s", b)
	}
	var s string
	_ = json.Unmarshal(st["status"], &s)
	return s
}

// TestSetPausedOutcomes runs setPaused against a fake control server
// (no runsc needed): the state file never says paused while the sentry
// may run, a call that certainly did nothing leaves the file as it was
// and falls back to runsc (errNoControl), a dead sandbox is
// FailedPrecondition, an unbalanced call is refused before anything is
// sent, and a caller's deadline that ends once the request is sent does
// not cut the wait for the answer short.
func TestSetPausedOutcomes(t *testing.T) {
	ctx := t.Context()
	live := os.Getpid()

	t.Run("resume", func(t *testing.T) {
		d, rid := unitSlot(t, "paused", live, "")
		f := serveFakeSentry(t, rid, answerOK)
		if err := d.setPaused(ctx, "sb", rid, false); err != nil {
			t.Fatal(err)
		}
		if s, calls := statusOf(t, d, rid), f.got(); s != "running" || len(calls) != 1 || calls[0] != methodResume {
			t.Fatalf("status %s, calls %v", s, calls)
		}
	})
	t.Run("pause", func(t *testing.T) {
		d, rid := unitSlot(t, "running", live, "")
		f := serveFakeSentry(t, rid, answerOK)
		if err := d.setPaused(ctx, "sb", rid, true); err != nil {
			t.Fatal(err)
		}
		if s, calls := statusOf(t, d, rid), f.got(); s != "paused" || len(calls) != 1 || calls[0] != methodPause {
			t.Fatalf("status %s, calls %v", s, calls)
		}
	})
	t.Run("unbalanced", func(t *testing.T) {
		d, rid := unitSlot(t, "running", live, "")
		f := serveFakeSentry(t, rid, answerOK)
		if err := d.setPaused(ctx, "sb", rid, false); !errdefs.IsFailedPrecondition(err) {
			t.Fatalf("resume of a running sandbox: %v", err)
		}
		if calls := f.got(); len(calls) != 0 {
			t.Fatalf("sent %v", calls)
		}
	})
	t.Run("refused", func(t *testing.T) {
		d, rid := unitSlot(t, "paused", live, "")
		serveFakeSentry(t, rid, answerRefuse)
		err := d.setPaused(ctx, "sb", rid, false)
		if !errors.Is(err, errNoControl) || statusOf(t, d, rid) != "paused" {
			t.Fatalf("%v, status %s; want errNoControl and paused", err, statusOf(t, d, rid))
		}
	})
	t.Run("no socket, live process", func(t *testing.T) {
		d, rid := unitSlot(t, "paused", live, "")
		err := d.setPaused(ctx, "sb", rid, false)
		if !errors.Is(err, errNoControl) || statusOf(t, d, rid) != "paused" {
			t.Fatalf("%v, status %s; want errNoControl and paused", err, statusOf(t, d, rid))
		}
	})
	t.Run("no socket, dead process", func(t *testing.T) {
		d, rid := unitSlot(t, "paused", 0, "")
		err := d.setPaused(ctx, "sb", rid, false)
		if !errdefs.IsFailedPrecondition(err) || statusOf(t, d, rid) != "paused" {
			t.Fatalf("%v, status %s; want FailedPrecondition and paused", err, statusOf(t, d, rid))
		}
	})
	t.Run("resume without answer", func(t *testing.T) {
		d, rid := unitSlot(t, "paused", live, "")
		serveFakeSentry(t, rid, answerNone)
		if err := d.setPaused(ctx, "sb", rid, false); !errdefs.IsUnavailable(err) {
			t.Fatalf("%v; want Unavailable", err)
		}
		// The sentry may have resumed: the file must not say paused.
		if s := statusOf(t, d, rid); s != "running" {
			t.Fatalf("status %s after an unanswered resume", s)
		}
	})
	t.Run("pause without answer", func(t *testing.T) {
		d, rid := unitSlot(t, "running", live, "")
		serveFakeSentry(t, rid, answerNone)
		if err := d.setPaused(ctx, "sb", rid, true); !errdefs.IsUnavailable(err) {
			t.Fatalf("%v; want Unavailable", err)
		}
		if s := statusOf(t, d, rid); s != "running" {
			t.Fatalf("status %s after an unanswered pause", s)
		}
	})
	t.Run("deadline after the request", func(t *testing.T) {
		d, rid := unitSlot(t, "paused", live, "")
		serveFakeSentry(t, rid, func(m string) []byte {
			time.Sleep(200 * time.Millisecond)
			return answerOK(m)
		})
		short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		defer cancel()
		if err := d.setPaused(short, "sb", rid, false); err != nil {
			t.Fatalf("answer after the caller's deadline: %v", err)
		}
		if s := statusOf(t, d, rid); s != "running" {
			t.Fatalf("status %s", s)
		}
	})
	t.Run("control socket path recorded", func(t *testing.T) {
		d, rid := unitSlot(t, "paused", live, `,"controlSocketPath":"/run/x.sock"`)
		f := serveFakeSentry(t, rid, answerOK)
		if err := d.setPaused(ctx, "sb", rid, false); !errors.Is(err, errStateFormat) {
			t.Fatalf("%v; want errStateFormat", err)
		}
		if calls := f.got(); len(calls) != 0 || statusOf(t, d, rid) != "paused" {
			t.Fatalf("sent %v", calls)
		}
	})
	t.Run("lock file replaced while waiting", func(t *testing.T) {
		d, rid := unitSlot(t, "paused", live, "")
		serveFakeSentry(t, rid, answerOK)
		old, err := os.Open(d.lockPath(rid))
		if err != nil {
			t.Fatal(err)
		}
		defer old.Close()
		if err := flockWait(ctx, old, syscall.LOCK_EX); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- d.setPaused(ctx, "sb", rid, false) }()
		time.Sleep(20 * time.Millisecond)
		// The slot's lock file is replaced (deleted and created again),
		// then the old lock is let go: setPaused must lock the new one.
		if err := os.Remove(d.lockPath(rid)); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(d.lockPath(rid), nil, 0o600); err != nil {
			t.Fatal(err)
		}
		newer, err := os.Open(d.lockPath(rid))
		if err != nil {
			t.Fatal(err)
		}
		defer newer.Close()
		if err := flockWait(ctx, newer, syscall.LOCK_EX); err != nil {
			t.Fatal(err)
		}
		old.Close()
		select {
		case err := <-done:
			t.Fatalf("setPaused went on under the replaced lock: %v", err)
		case <-time.After(100 * time.Millisecond):
		}
		newer.Close()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if s := statusOf(t, d, rid); s != "running" {
			t.Fatalf("status %s", s)
		}
	})
}
