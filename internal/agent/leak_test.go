package agent

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
	"github.com/cubesandbox/cube/internal/agent/fsys"
	"github.com/cubesandbox/cube/internal/agent/procs"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/testenv"
)

func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// TestNothingLeaks drives processes through every ending (exit, kill,
// timeout, client gone, failed start) and uploads through failure, then
// checks that the agent holds no more file descriptors (pipes, PTYs,
// inotify) or goroutines than before, and left no files.
func TestNothingLeaks(t *testing.T) {
	testenv.RequireRoot(t, "acts as other users")
	db, home, _ := sandboxLike(t)
	srv := New(Config{Starter: reaper, Users: db, Logger: slog.New(slog.DiscardHandler)})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, ln) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	}()
	base := "http://" + ln.Addr().String()
	hc := &http.Client{Transport: &http.Transport{}}
	client := processconnect.NewProcessClient(hc, base, connect.WithProtoJSON())

	settle := func() (int, int) {
		hc.CloseIdleConnections()
		time.Sleep(200 * time.Millisecond)
		return openFDs(t), runtime.NumGoroutine()
	}
	// One warm-up round, so lazily created runtime state is not counted.
	run := func(req *pb.StartRequest, timeout time.Duration, disconnectEarly bool) {
		rctx, rcancel := context.WithTimeout(ctx, timeout)
		defer rcancel()
		s, err := client.Start(rctx, connect.NewRequest(req))
		if err != nil {
			return
		}
		for s.Receive() {
			if disconnectEarly {
				break
			}
		}
		s.Close()
	}
	yes := true
	pty := &pb.PTY{Size: &pb.PTY_Size{Cols: 80, Rows: 24}}
	round := func() {
		run(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", "echo x; echo y >&2"}}}, 10*time.Second, false)
		run(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "cat"}, Stdin: &yes}, 300*time.Millisecond, false) // killed by its timeout
		run(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", "exit 0"}}, Pty: pty}, 10*time.Second, false)
		run(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", "sleep 0.3 &"}}}, 10*time.Second, false)
		run(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "sleep", Args: []string{"0.2"}}, Pty: pty}, 10*time.Second, true) // client leaves first
		run(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: filepath.Join(home, "not-executable")}}, 10*time.Second, false)
	}
	if err := os.WriteFile(filepath.Join(home, "not-executable"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	round()
	time.Sleep(500 * time.Millisecond) // the early-left sleep ends
	fds0, gr0 := settle()

	for range 3 {
		round()
	}
	// Starts that fail after their pipes/PTY were made.
	if err := failpoint.Enable(procs.FailpointStart, "error"); err != nil {
		t.Fatal(err)
	}
	for _, p := range []*pb.PTY{nil, pty} {
		s, err := client.Start(ctx, connect.NewRequest(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "true"}, Pty: p, Stdin: &yes}))
		if err == nil {
			for s.Receive() {
			}
			err = s.Err()
			s.Close()
		}
		if err == nil || !strings.Contains(err.Error(), "injected") {
			t.Errorf("start with failpoint: %v", err)
		}
	}
	failpoint.Disable(procs.FailpointStart)

	// An upload that fails after creating its file and parents.
	if err := failpoint.Enable(fsys.FailpointWrite, "error"); err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequest("POST", base+"/files?path="+filepath.Join(home, "new/dirs/f.txt"), strings.NewReader("data"))
	req.Header.Set("Content-Type", "application/octet-stream")
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	failpoint.Disable(fsys.FailpointWrite)
	if resp.StatusCode != http.StatusInternalServerError {
		t.Errorf("failed upload: %d", resp.StatusCode)
	}
	if _, err := os.Stat(filepath.Join(home, "new")); !os.IsNotExist(err) {
		t.Errorf("failed upload left its directories: %v", err)
	}

	time.Sleep(500 * time.Millisecond)
	deadline := time.Now().Add(10 * time.Second)
	for i := 0; ; i++ {
		fds, gr := settle()
		if fds <= fds0 && gr <= gr0+2 {
			t.Logf("settled after %d tries: fds %d->%d goroutines %d->%d", i, fds0, fds, gr0, gr)
			break
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadDir("/proc/self/fd")
			var targets []string
			for _, e := range b {
				l, _ := os.Readlink(filepath.Join("/proc/self/fd", e.Name()))
				targets = append(targets, l)
			}
			buf := make([]byte, 1<<20)
			n := runtime.Stack(buf, true)
			t.Fatalf("fds %d -> %d, goroutines %d -> %d; open: %v\n%s", fds0, fds, gr0, gr, targets, buf[:n])
		}
	}
	list, err := client.List(ctx, connect.NewRequest(&pb.ListRequest{}))
	if err != nil || len(list.Msg.GetProcesses()) != 0 {
		t.Errorf("processes still registered: %v %v", list, err)
	}
}
