package agentchan

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"
)

// A spare connection is what the next request runs on: no dial, no
// handshake, no HTTP/2 set-up after it, and it outlives a freeze that
// the health pings of a live connection do not (the control). One whose
// chardev end hung up (its QEMU exited) is replaced by a new connection
// instead of failing the request.
func TestSpare(t *testing.T) {
	defer func(r, p time.Duration) { readIdleTimeout, pingTimeout = r, p }(readIdleTimeout, pingTimeout)
	readIdleTimeout, pingTimeout = 20*time.Millisecond, 20*time.Millisecond
	v := startVM(t, testHandler(nil))
	ch := NewSerial(v.sock)
	defer ch.Close()
	ctx := context.Background()
	freeze := func() {
		v.gate.Lock()
		time.Sleep(300 * time.Millisecond) // many ping bounds
		v.gate.Unlock()
	}

	// Control: a live connection across a freeze is closed by its pings.
	if got, err := get(ctx, t, ch.HTTP, "/session"); err != nil || got != "1" {
		t.Fatalf("GET /session = %q, %v; want session 1", got, err)
	}
	freeze()
	if got, err := get(ctx, t, ch.HTTP, "/session"); err != nil || got != "2" {
		t.Fatalf("GET /session after a freeze = %q, %v; want a new session 2 (the pings closed the first)", got, err)
	}
	if n := v.accepted.Load(); n != 2 {
		t.Fatalf("%d connections accepted, want 2", n)
	}

	if err := ch.Spare(ctx); err != nil {
		t.Fatalf("Spare: %v", err)
	}
	if n, s := v.accepted.Load(), v.started.Load(); n != 3 || s != 3 {
		t.Fatalf("after Spare: %d connections accepted, %d sessions started; want 3 and 3", n, s)
	}
	freeze()
	if got, err := get(ctx, t, ch.HTTP, "/session"); err != nil || got != "3" {
		t.Fatalf("GET /session after Spare and a freeze = %q, %v; want the spare's session 3", got, err)
	}
	if got, err := get(ctx, t, ch.HTTP, "/session"); err != nil || got != "3" {
		t.Fatalf("second GET /session = %q, %v; want the spare's session 3 until the connections are closed", got, err)
	}
	if n := v.accepted.Load(); n != 3 {
		t.Fatalf("the requests after Spare dialed again: %d connections accepted, want 3", n)
	}

	// A spare whose chardev end hung up.
	if err := ch.Spare(ctx); err != nil {
		t.Fatalf("Spare: %v", err)
	}
	if n := v.accepted.Load(); n != 4 {
		t.Fatalf("a second Spare: %d connections accepted, want 4 (the old spare closed, a new one dialed)", n)
	}
	v.hangUp()
	if got, err := get(ctx, t, ch.HTTP, "/session"); err != nil || got != "5" {
		t.Fatalf("GET /session after the spare hung up = %q, %v; want a new session 5", got, err)
	}
	if n := v.accepted.Load(); n != 5 {
		t.Fatalf("%d connections accepted, want 5 (a new one for the hung-up spare)", n)
	}
}

// A guest session's write that comes after the session closed (its
// HTTP/2 server answering a PING late) fails, even once the next session
// has cleared the port's deadline; the port itself still writes (the
// control).
func TestSessionWriteAfterClose(t *testing.T) {
	guest, host := filePair(t)
	defer guest.Close()
	defer host.Close()
	port := &portConn{File: guest}
	s := &sessionConn{Conn: port}
	if _, err := s.Write([]byte("in session")); err != nil {
		t.Fatalf("write in session: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := guest.SetDeadline(time.Time{}); err != nil { // the next session starts
		t.Fatal(err)
	}
	if _, err := s.Write([]byte("late")); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("write after close: %v, want net.ErrClosed", err)
	}
	if _, err := port.Write([]byte("next session")); err != nil {
		t.Fatalf("the port after the session closed: %v", err)
	}
}
