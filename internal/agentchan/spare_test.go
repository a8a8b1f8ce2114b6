package agentchan

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
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

// A read of an ended session has returned by the time Close does, so it
// cannot take the next session's bytes once the port's deadline is
// cleared; and guestSync hands the session such a conn.
func TestSessionReadEndsWithClose(t *testing.T) {
	guest, host := filePair(t)
	defer guest.Close()
	defer host.Close()
	port := &portConn{File: guest}
	if _, err := host.Write([]byte(syncPrefix + "n1\n" + h2Preface)); err != nil {
		t.Fatal(err)
	}
	c, err := guestSync(port)
	if err != nil {
		t.Fatal(err)
	}
	s, ok := c.(*sessionConn)
	if !ok {
		t.Fatalf("guestSync returned a %T, want *sessionConn", c)
	}
	if _, err := io.ReadFull(s, make([]byte, len(h2Preface))); err != nil {
		t.Fatal(err)
	}
	got := make(chan error, 1)
	go func() {
		_, err := s.Read(make([]byte, 64))
		got <- err
	}()
	time.Sleep(20 * time.Millisecond) // the read waits in the port
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-got:
		if err == nil {
			t.Fatal("the ended session's read returned data")
		}
	default:
		t.Fatal("Close returned while the session's read was still in the port")
	}
	if err := guest.SetDeadline(time.Time{}); err != nil { // the next session starts
		t.Fatal(err)
	}
	if _, err := s.Read(make([]byte, 1)); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("read after close: %v, want net.ErrClosed", err)
	}
	if err := s.SetDeadline(time.Time{}); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("deadline after close: %v, want net.ErrClosed", err)
	}
	if _, err := host.Write([]byte("next")); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 4)
	if _, err := io.ReadFull(port, b); err != nil || string(b) != "next" {
		t.Fatalf("the next session read %q, %v; want \"next\"", b, err)
	}
}

// A Spare that fails (the guest does not answer its GET /health in time,
// the connection being up) leaves no connection up: the next request
// dials on the live transport and is answered, instead of waiting for the
// QEMU slot the spare would still hold.
func TestSpareFailureLeavesNoConnection(t *testing.T) {
	stall := make(chan struct{})
	defer close(stall)
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-stall:
		case <-r.Context().Done():
		}
	})
	mux.Handle("/", testHandler(nil))
	v := startVM(t, mux)
	ch := NewSerial(v.sock)
	defer ch.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	err := ch.Spare(ctx)
	cancel()
	if err == nil {
		t.Fatal("Spare succeeded though the guest never answered")
	}
	if n := v.started.Load(); n != 1 {
		t.Fatalf("%d sessions started, want 1 (the spare's, up when its request timed out)", n)
	}
	if got, err := get(context.Background(), t, ch.HTTP, "/session"); err != nil || got != "2" {
		t.Fatalf("GET /session after a failed Spare = %q, %v; want an answer on a new session 2", got, err)
	}
}
