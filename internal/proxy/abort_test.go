package proxy_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/proxy"
)

// TestAbortEndsRequestsOfAGoneSandbox: the upstream accepts and never
// answers nor closes (a gVisor sandbox killed with its network stack: no
// FIN, no RST). Abort of the sandbox ends the request at once with 502
// and the cause; a request to another sandbox is not touched. Without
// Abort the request waits for the client's own timeout (checked as the
// control: it is still waiting when Abort is called).
func TestAbortEndsRequestsOfAGoneSandbox(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	var held []net.Conn
	t.Cleanup(func() {
		for _, c := range held {
			c.Close()
		}
	})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			held = append(held, c)
			go func() { _, _ = io.Copy(io.Discard, c) }() // reads, never answers
		}
	}()
	port := ln.Addr().(*net.TCPAddr).Port
	h := proxy.New(proxy.Config{Domain: "cube.test", Resolver: resolverFunc(func(_ context.Context, id string) (*proxy.Target, error) {
		return &proxy.Target{SandboxID: id, HostIP: "127.0.0.1"}, nil
	})})
	pl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = h.Serve(ctx, pl); close(done) }()
	t.Cleanup(func() { cancel(); <-done })

	type answer struct {
		code int
		body string
		err  error
		took time.Duration
	}
	send := func(id string) <-chan answer {
		ch := make(chan answer, 1)
		go func() {
			start := time.Now()
			req, _ := http.NewRequest(http.MethodGet, "http://"+pl.Addr().String()+"/", nil)
			req.Host = fmt.Sprintf("%d-%s.cube.test", port, id)
			hc := &http.Client{Timeout: 20 * time.Second}
			resp, err := hc.Do(req)
			if err != nil {
				ch <- answer{err: err, took: time.Since(start)}
				return
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			ch <- answer{code: resp.StatusCode, body: string(b), took: time.Since(start)}
		}()
		return ch
	}
	gone, other := send("sbgone"), send("sbother")
	deadline := time.Now().Add(5 * time.Second)
	for !h.InFlight("sbgone") || !h.InFlight("sbother") {
		if time.Now().After(deadline) {
			t.Fatal("requests never reached the upstream")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// Control: nothing answers the request by itself.
	select {
	case a := <-gone:
		t.Fatalf("the request ended before Abort: %+v", a)
	case <-time.After(500 * time.Millisecond):
	}
	if n := h.Abort("sbgone", fmt.Errorf("sandbox sbgone is gone: %w", errdefs.ErrNotFound)); n != 1 {
		t.Fatalf("Abort ended %d requests, want 1", n)
	}
	select {
	case a := <-gone:
		if a.err != nil || a.code != http.StatusBadGateway || !strings.Contains(a.body, "is gone") {
			t.Fatalf("aborted request: %+v", a)
		}
		t.Logf("aborted request answered %d after %s: %s", a.code, a.took, strings.TrimSpace(a.body))
	case <-time.After(5 * time.Second):
		t.Fatal("the aborted request still hangs")
	}
	select {
	case a := <-other:
		t.Fatalf("a request to another sandbox ended: %+v", a)
	case <-time.After(200 * time.Millisecond):
	}
	if !h.InFlight("sbother") || h.InFlight("sbgone") {
		t.Fatal("in-flight bookkeeping wrong after Abort")
	}
	h.Abort("sbother", fmt.Errorf("cleanup: %w", errdefs.ErrNotFound))
	<-other
}
