package nsdial

import (
	"bufio"
	"io"
	"net"
	"runtime"
	"strings"
	"testing"
	"time"
)

func TestForwarderRelaysIntoNetns(t *testing.T) {
	path, ln := newNetns(t)
	// An upper-casing echo server that answers only after the client's
	// half-close: proves EOF crosses the forwarder and replies still flow.
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				b, _ := io.ReadAll(c)
				_, _ = c.Write([]byte(strings.ToUpper(string(b))))
			}()
		}
	}()
	before := runtime.NumGoroutine()
	f, err := Forward("127.0.0.1:0", path, ln.Addr().String(), nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		c, err := net.DialTimeout("tcp", f.Addr(), 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		msg := strings.Repeat("ping", 1<<(i*3)) // up to 16 KiB
		if _, err := c.Write([]byte(msg)); err != nil {
			t.Fatal(err)
		}
		if err := c.(*net.TCPConn).CloseWrite(); err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(c)
		c.Close()
		if err != nil || string(got) != strings.ToUpper(msg) {
			t.Fatalf("round %d: got %d bytes (%v), want %d", i, len(got), err, len(msg))
		}
	}

	// A connection still open when the Forwarder closes is cut.
	c, err := net.Dial("tcp", f.Addr())
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond) // let it be relayed
	done := make(chan error, 1)
	go func() { done <- f.Close() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Close: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close hung on an open connection")
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := bufio.NewReader(c).ReadByte(); err == nil {
		t.Fatal("relayed connection survived Close")
	}
	c.Close()
	if _, err := net.DialTimeout("tcp", f.Addr(), time.Second); err == nil {
		t.Fatal("listener survived Close")
	}
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > before+1 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > before+1 {
		t.Fatalf("goroutines: %d before, %d after Close", before, n)
	}
}

func TestForwarderUnreachableTarget(t *testing.T) {
	path, ln := newNetns(t)
	addr := ln.Addr().String()
	ln.Close() // nothing listens there any more
	f, err := Forward("127.0.0.1:0", path, addr, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	c, err := net.Dial("tcp", f.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := c.Read(make([]byte, 1)); err == nil || n != 0 {
		t.Fatalf("read from unreachable target: n=%d err=%v, want EOF", n, err)
	}
	if _, err := Forward("127.0.0.1:0", path, "no-port", nil); err == nil {
		t.Fatal("bad target accepted")
	}
}
