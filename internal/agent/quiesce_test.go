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
	"strconv"
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
		if left := endpointsOf(t, port); len(left) > 0 {
			t.Fatalf("round %d: the agent's port still has %s after the quiesce", round, strings.Join(left, ", "))
		}
		srv.Wake()
	}
}

// endpointsOf lists the TCP endpoints on local port (hex in /proc/net/tcp)
// that are this process's or nobody's (TIME_WAIT and the other states of
// a closed socket have inode 0). Once the agent's listener is closed its
// port is free, and another process on the host (go test runs packages in
// parallel) may take it as the ephemeral port of its own connection: such
// a socket has an owner, and it is not this process.
func endpointsOf(t *testing.T, port string) []string {
	t.Helper()
	own := map[string]bool{}
	fds, _ := os.ReadDir("/proc/self/fd")
	for _, fd := range fds {
		if l, err := os.Readlink("/proc/self/fd/" + fd.Name()); err == nil {
			if ino, ok := strings.CutPrefix(l, "socket:["); ok {
				own[strings.TrimSuffix(ino, "]")] = true
			}
		}
	}
	b, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, line := range strings.Split(string(b), "\n")[1:] {
		f := strings.Fields(line)
		if len(f) < 10 {
			continue
		}
		_, p, _ := strings.Cut(f[1], ":")
		n, err := strconv.ParseUint(p, 16, 16)
		if err != nil || strconv.FormatUint(n, 10) != port {
			continue
		}
		if f[9] != "0" && !own[f[9]] {
			continue
		}
		local, _ := hexAddr(f[1])
		remote, _ := hexAddr(f[2])
		out = append(out, fmt.Sprintf("%s %s -> %s (inode %s)", tcpStates[strings.ToUpper(f[3])], local, remote, f[9]))
	}
	return out
}
