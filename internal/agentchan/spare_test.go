package agentchan

import (
	"context"
	"testing"
	"time"
)

// A spare session is what the next request runs on: no dial, no
// handshake after it. One whose chardev end hung up (its QEMU exited) is
// dropped for a new connection instead of failing the request.
func TestSpare(t *testing.T) {
	v := startVM(t, testHandler(nil))
	ch := NewSerial(v.sock)
	defer ch.Close()
	ctx := context.Background()

	if got, err := get(ctx, t, ch.HTTP, "/session"); err != nil || got != "1" {
		t.Fatalf("GET /session = %q, %v; want session 1", got, err)
	}
	if err := ch.Spare(ctx); err != nil {
		t.Fatalf("Spare: %v", err)
	}
	if n := v.accepted.Load(); n != 2 {
		t.Fatalf("after Spare the chardev accepted %d connections, want 2 (the first request's, then the spare's)", n)
	}
	// Held and still open: kept, not dialed again.
	if err := ch.Spare(ctx); err != nil {
		t.Fatalf("second Spare: %v", err)
	}
	if got, err := get(ctx, t, ch.HTTP, "/session"); err != nil || got != "2" {
		t.Fatalf("GET /session after Spare = %q, %v; want session 2", got, err)
	}
	if n := v.accepted.Load(); n != 2 {
		t.Fatalf("the request after Spare dialed again: %d connections accepted, want 2", n)
	}

	// A spare whose chardev end hung up.
	ch.HTTP.CloseIdleConnections()
	if err := ch.Spare(ctx); err != nil {
		t.Fatalf("Spare: %v", err)
	}
	waitFor(t, "the spare's connection accepted", 2*time.Second, func() bool { return v.accepted.Load() == 3 })
	v.hangUp()
	waitFor(t, "the spare to see the hang-up", 2*time.Second, func() bool {
		ch.mu.Lock()
		defer ch.mu.Unlock()
		return ch.spare != nil && !open(ch.spare)
	})
	if got, err := get(ctx, t, ch.HTTP, "/session"); err != nil || got != "3" {
		t.Fatalf("GET /session after the spare hung up = %q, %v; want a new session 3", got, err)
	}
	if n := v.accepted.Load(); n != 4 {
		t.Fatalf("%d connections accepted, want 4 (a new one for the hung-up spare)", n)
	}
}
