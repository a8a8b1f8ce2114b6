package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/cubesandbox/cube/internal/agentproto"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

const tcpHeader = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"

func writeTCP(t *testing.T, dir string, lines ...string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, "tcp"), []byte(tcpHeader+strings.Join(lines, "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestForeignSockets(t *testing.T) {
	dir := t.TempDir()
	writeTCP(t, dir,
		"   0: 00000000:C34F 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1",
		"   1: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2 1",
		"   2: 0200000A:C34F 0100000A:D431 01 00000000:00000000 00:00000000 00000000     0        0 3 1")
	got, err := ForeignSockets(dir, 49999)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0] != (agentproto.Socket{Local: "127.0.0.1:8080", Remote: "0.0.0.0:0", State: "LISTEN"}) {
		t.Fatalf("foreign sockets = %+v, want the listener on 8080 only", got)
	}
	writeTCP(t, dir, "   0: zz:1 00000000:0000 0A")
	if _, err := ForeignSockets(dir, 49999); err == nil {
		t.Fatal("a malformed table was accepted")
	}
}

// TestQuiesceAndWake: a quiesce closes the listener and every connection
// (an idle keep-alive one included), nothing answers until Wake, then the
// agent serves again on the same port; with a foreign socket open the
// quiesce is refused and nothing changes.
func TestQuiesceAndWake(t *testing.T) {
	procNet := t.TempDir()
	writeTCP(t, procNet) // empty: only the agent's sockets, which the file need not list
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	srv := New(Config{ProcNet: procNet})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	base := "http://" + addr
	idle := &http.Client{Transport: &http.Transport{}}
	if resp, err := idle.Get(base + "/health"); err != nil {
		t.Fatal(err)
	} else {
		resp.Body.Close()
	}
	quiesce := func(wantStatus int) agentproto.QuiesceResponse {
		t.Helper()
		c := &http.Client{Transport: &http.Transport{}}
		defer c.CloseIdleConnections()
		resp, err := c.Post(base+"/_cube/quiesce", "application/json", strings.NewReader(`{"timeout_ms":20000}`))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var res agentproto.QuiesceResponse
		_ = json.NewDecoder(resp.Body).Decode(&res)
		if resp.StatusCode != wantStatus {
			t.Fatalf("quiesce: %s %+v, want %d", resp.Status, res, wantStatus)
		}
		return res
	}

	writeTCP(t, procNet, "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2 1")
	if res := quiesce(http.StatusConflict); !strings.Contains(res.Error, "127.0.0.1:8080") {
		t.Fatalf("refusal does not name the listener: %+v", res)
	}
	if resp, err := idle.Get(base + "/health"); err != nil {
		t.Fatalf("agent stopped serving after a refused quiesce: %v", err)
	} else {
		resp.Body.Close()
	}

	writeTCP(t, procNet)
	quiesce(http.StatusOK)
	deadline := time.Now().Add(3 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
		if err != nil {
			break
		}
		c.Close()
		if time.Now().After(deadline) {
			t.Fatal("agent still accepts connections 3 s after a quiesce")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if resp, err := idle.Get(base + "/health"); err == nil {
		resp.Body.Close()
		t.Fatal("an idle connection survived the quiesce")
	}

	srv.Wake()
	if err := waitHealth(base, 3*time.Second); err != nil {
		t.Fatalf("after wake: %v", err)
	}
}

func waitHealth(base string, within time.Duration) error {
	deadline := time.Now().Add(within)
	c := &http.Client{Transport: &http.Transport{}, Timeout: time.Second}
	defer c.CloseIdleConnections()
	for {
		resp, err := c.Get(base + "/health")
		if err == nil {
			resp.Body.Close()
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no /health within %s: %w", within, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestQuiesceLeavesNoEndpoint: a quiesce while a client keeps dialing the
// agent (as cubelet does, waiting for the port to refuse) leaves no
// endpoint of the agent's port in any state once the port refuses: every
// connection the agent accepted was reset, none closed with a FIN into
// TIME_WAIT, which runsc cannot save. Rounds of it, since the race is
// between an accept and the teardown.
func TestQuiesceLeavesNoEndpoint(t *testing.T) {
	procNet := t.TempDir()
	writeTCP(t, procNet)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_, port, _ := net.SplitHostPort(addr)
	srv := New(Config{ProcNet: procNet})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	base := "http://" + addr
	rst := func(c net.Conn) {
		if tc, ok := c.(*net.TCPConn); ok {
			_ = tc.SetLinger(0)
		}
		c.Close()
	}
	for round := range 20 {
		if err := waitHealth(base, 5*time.Second); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(c, "POST /_cube/quiesce HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\nContent-Length: 20\r\n\r\n{\"timeout_ms\":20000}")
		buf := make([]byte, 4096)
		if _, err := c.Read(buf); err != nil || !strings.HasPrefix(string(buf), "HTTP/1.1 200") {
			t.Fatalf("round %d: quiesce answer %q %v", round, buf[:min(len(buf), 40)], err)
		}
		rst(c)
		// Dial until refused, each probe reset, as cubelet does.
		for {
			p, err := net.DialTimeout("tcp", addr, time.Second)
			if errors.Is(err, syscall.ECONNREFUSED) {
				break
			}
			if errors.Is(err, syscall.ECONNRESET) {
				continue // queued when the listener closed
			}
			if err != nil {
				t.Fatalf("round %d: probe: %v", round, err)
			}
			rst(p)
		}
		socks, err := readTCPTable("/proc/net/tcp")
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range socks {
			if _, p, _ := net.SplitHostPort(s.Local); p == port {
				t.Fatalf("round %d: the agent's port still has %s %s -> %s after the quiesce", round, s.State, s.Local, s.Remote)
			}
		}
		srv.Wake()
	}
}
