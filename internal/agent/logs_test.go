package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
	"github.com/cubesandbox/cube/internal/agent/logring"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/testenv"
)

// TestLogs: the output lines of processes started through envd reach
// GET /_cube/logs with their stream, PID and command, pages by time and
// count, and a terminal (PTY) session's screen does not; the ring's cap
// bounds what a process that prints a lot leaves.
func TestLogs(t *testing.T) {
	testenv.RequireRoot(t, "starts processes as other users")
	db, _, _ := sandboxLike(t)
	ring := logring.New(64 << 10)
	srv := New(Config{Starter: reaper, Users: db, Logs: ring, Logger: slog.New(slog.DiscardHandler)})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	base := "http://" + ln.Addr().String()
	pc := processconnect.NewProcessClient(http.DefaultClient, base)
	run := func(t *testing.T, cfg *pb.ProcessConfig, pty bool) uint32 {
		t.Helper()
		req := &pb.StartRequest{Process: cfg}
		if pty {
			req.Pty = &pb.PTY{Size: &pb.PTY_Size{Cols: 80, Rows: 24}}
		}
		s, err := pc.Start(ctx, connect.NewRequest(req))
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		var pid uint32
		for s.Receive() {
			ev := s.Msg().GetEvent()
			if st := ev.GetStart(); st != nil {
				pid = st.GetPid()
			}
			if ev.GetEnd() != nil {
				return pid
			}
		}
		t.Fatalf("no end: %v", s.Err())
		return 0
	}
	logs := func(t *testing.T, query string) agentproto.LogsResponse {
		t.Helper()
		resp, err := http.Get(base + agentproto.PathLogs + query)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("GET logs%s: %s", query, resp.Status)
		}
		var out agentproto.LogsResponse
		if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
			t.Fatal(err)
		}
		return out
	}

	begin := time.Now()
	pid := run(t, &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", "echo out one; echo err one >&2; printf 'no newline'"}}, false)
	ptyPID := run(t, &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", "echo on the terminal"}}, true)
	got := logs(t, "")
	var mine []string
	for _, e := range got.Entries {
		if e.PID == ptyPID {
			t.Errorf("a PTY session's output was kept: %+v", e)
		}
		if e.PID == pid {
			if e.Source != agentproto.LogSourceProcess || e.Cmd != "/bin/sh" {
				t.Errorf("entry %+v", e)
			}
			mine = append(mine, e.Stream+":"+e.Line)
		}
	}
	t.Logf("pid %d: %q", pid, mine)
	if len(mine) != 3 || !strings.Contains(strings.Join(mine, "|"), "stdout:out one") ||
		!strings.Contains(strings.Join(mine, "|"), "stderr:err one") || !strings.Contains(strings.Join(mine, "|"), "stdout:no newline") {
		t.Fatalf("process lines %q", mine)
	}

	// Paging: 30 lines, read 4 entries at a time after a sequence cursor.
	run(t, &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", "for i in $(seq 1 30); do echo page $i; done"}}, false)
	var paged []string
	after := uint64(0)
	for i := 0; i < 100; i++ {
		page := logs(t, fmt.Sprintf("?after=%d&limit=4", after))
		if len(page.Entries) == 0 {
			break
		}
		for _, e := range page.Entries {
			if strings.HasPrefix(e.Line, "page ") {
				paged = append(paged, e.Line)
			}
		}
		after = page.Entries[len(page.Entries)-1].Seq
	}
	seen := map[string]bool{}
	for _, l := range paged {
		seen[l] = true
	}
	if len(seen) != 30 || len(paged) != 30 {
		t.Fatalf("paged through %d distinct lines of 30: %q", len(seen), paged)
	}
	// By time: nothing from before the test began, nothing after now.
	if got := logs(t, fmt.Sprintf("?end=%d", begin.UnixMilli()-1)); len(got.Entries) != 0 {
		t.Errorf("entries before the test: %+v", got.Entries)
	}
	if got := logs(t, fmt.Sprintf("?start=%d", time.Now().Add(time.Second).UnixMilli())); len(got.Entries) != 0 {
		t.Errorf("entries from the future: %+v", got.Entries)
	}
	back := logs(t, "?direction=backward&limit=3")
	if len(back.Entries) != 3 || back.Entries[0].Seq < back.Entries[2].Seq {
		t.Fatalf("backward: %+v", back.Entries)
	}

	// The cap: a process printing 1 MB leaves at most 64 KiB.
	run(t, &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", "i=0; while [ $i -lt 10000 ]; do echo line $i padded to about one hundred bytes ........................................; i=$((i+1)); done"}}, false)
	all := logs(t, "?limit=1000")
	size := 0
	for _, e := range all.Entries {
		size += len(e.Line)
	}
	t.Logf("after 1 MB of output: %d entries (%d bytes of text) kept, %d dropped", len(all.Entries), size, all.Dropped)
	if all.Dropped < 9000 || size > 64<<10 {
		t.Fatalf("cap not held: %d bytes kept, %d dropped", size, all.Dropped)
	}
	r, err := http.Get(base + agentproto.PathLogs + "?limit=0")
	if err != nil {
		t.Fatal(err)
	}
	r.Body.Close()
	if r.StatusCode != 400 {
		t.Fatalf("limit=0: %s", r.Status)
	}
}
