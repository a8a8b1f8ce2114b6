package agenttest

import (
	"context"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
)

func (h *harness) testProcess(t *testing.T) {
	t.Run("OutputAndExit", h.testOutputAndExit)
	t.Run("EnvCwdUser", h.testEnvCwdUser)
	t.Run("Stdin", h.testStdin)
	t.Run("PTY", h.testPTY)
	t.Run("BackgroundTagConnectKill", h.testBackground)
	t.Run("KeepaliveAndTimeout", h.testKeepaliveAndTimeout)
	t.Run("StreamInputH2C", h.testStreamInput)
	t.Run("OrphanKeepsPipeOpen", h.testOrphan)
	t.Run("Errors", h.testProcessErrors)
}

func (h *harness) testOutputAndExit(t *testing.T) {
	for name, client := range map[string]processconnect.ProcessClient{"json-http1": h.proc, "binary-h2c": h.procBin} {
		r, err := h.run(ctxT(t), client, as(h, "", sh("echo out; echo err >&2; exit 3")))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if r.pid == 0 || r.stdout != "out\n" || r.stderr != "err\n" {
			t.Errorf("%s: pid=%d stdout=%q stderr=%q", name, r.pid, r.stdout, r.stderr)
		}
		if e := r.end; e.GetExitCode() != 3 || !e.GetExited() || e.GetStatus() != "exit status 3" || e.GetError() != "exit status 3" {
			t.Errorf("%s: end %s", name, fmtEnd(e))
		}
	}
	r, err := h.run(ctxT(t), h.proc, as(h, "", sh("true")))
	if err != nil || r.end.GetExitCode() != 0 || r.end.Error != nil || r.end.GetStatus() != "exit status 0" {
		t.Errorf("true: %v %s", err, fmtEnd(r.end))
	}
	// Large output arrives whole and in order.
	r, err = h.run(ctxT(t), h.proc, as(h, "", sh("i=0; while [ $i -lt 2000 ]; do echo line-$i; i=$((i+1)); done")))
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSuffix(r.stdout, "\n"), "\n")
	if len(lines) != 2000 || lines[0] != "line-0" || lines[1999] != "line-1999" {
		t.Errorf("large output: %d lines, first %q", len(lines), lines[0])
	}
}

func (h *harness) testEnvCwdUser(t *testing.T) {
	req := sh(`echo "$FOO|$PWD|$(id -u):$(id -g)|$HOME|$USER|$LOGNAME"`)
	req.Process.Envs = map[string]string{"FOO": "bar baz"}
	cwd := "/tmp"
	req.Process.Cwd = &cwd
	r, err := h.run(ctxT(t), h.proc, as(h, "user", req))
	if err != nil {
		t.Fatal(err)
	}
	if want := "bar baz|/tmp|1000:1000|" + h.tg.UserHome + "|user|user\n"; r.stdout != want {
		t.Errorf("as user: %q, want %q", r.stdout, want)
	}
	for k, v := range h.tg.Env {
		r, err := h.run(ctxT(t), h.proc, as(h, "", sh(`printf %s "$`+k+`"`)))
		if err != nil || r.stdout != v {
			t.Errorf("sandbox env %s = %q (%v), want %q", k, r.stdout, err, v)
		}
	}
	// No cwd: the user's home. No user: the default user ("user").
	r, err = h.run(ctxT(t), h.proc, as(h, "", sh("pwd; id -u")))
	if err != nil || r.stdout != h.tg.UserHome+"\n1000\n" {
		t.Errorf("defaults: %q %v", r.stdout, err)
	}
	r, err = h.run(ctxT(t), h.proc, as(h, "root", sh("id -u; echo $HOME")))
	if err != nil || r.stdout != "0\n/root\n" {
		t.Errorf("as root: %q %v", r.stdout, err)
	}
	// The user cannot enter root's directory: the kernel says no.
	r, err = h.run(ctxT(t), h.proc, as(h, "user", sh("ls "+h.tg.RootOnly)))
	if err != nil || r.end.GetExitCode() == 0 || !strings.Contains(r.stderr, "denied") {
		t.Errorf("user listing root dir: code %d stderr %q err %v", r.end.GetExitCode(), r.stderr, err)
	}
}

// startStream starts a process and returns the stream after the start
// event, and its pid.
func (h *harness) startStream(t *testing.T, ctx context.Context, c processconnect.ProcessClient, req *connect.Request[pb.StartRequest]) (*connect.ServerStreamForClient[pb.StartResponse], uint32) {
	t.Helper()
	s, err := c.Start(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if !s.Receive() {
		t.Fatalf("no start event: %v", s.Err())
	}
	pid := s.Msg().GetEvent().GetStart().GetPid()
	if pid == 0 {
		t.Fatalf("first event is not start: %v", s.Msg())
	}
	return s, pid
}

// collect reads a stream to its end.
func collect(s interface {
	Receive() bool
	Err() error
}, msg func() *pb.ProcessEvent) (result, error) {
	var r result
	for s.Receive() {
		r.add(msg())
	}
	return r, s.Err()
}

func (h *harness) testStdin(t *testing.T) {
	ctx := ctxT(t)
	yes := true
	req := &pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "cat"}, Stdin: &yes}
	s, pid := h.startStream(t, ctx, h.proc, as(h, "", req))
	sel := &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: pid}}
	for _, chunk := range []string{"hello ", "world"} {
		if _, err := h.proc.SendInput(ctx, as(h, "", &pb.SendInputRequest{Process: sel, Input: &pb.ProcessInput{Input: &pb.ProcessInput_Stdin{Stdin: []byte(chunk)}}})); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := h.proc.CloseStdin(ctx, as(h, "", &pb.CloseStdinRequest{Process: sel})); err != nil {
		t.Fatal(err)
	}
	r, err := collect(s, func() *pb.ProcessEvent { return s.Msg().GetEvent() })
	if err != nil || r.stdout != "hello world" || r.end.GetExitCode() != 0 {
		t.Errorf("cat: %q %s %v", r.stdout, fmtEnd(r.end), err)
	}
	// stdin off: the process reads /dev/null and ends at once.
	no := false
	r, err = h.run(ctx, h.proc, as(h, "", &pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "cat"}, Stdin: &no}))
	if err != nil || r.stdout != "" || r.end.GetExitCode() != 0 {
		t.Errorf("cat without stdin: %q %s %v", r.stdout, fmtEnd(r.end), err)
	}
}

func (h *harness) testPTY(t *testing.T) {
	ctx := ctxT(t)
	req := &pb.StartRequest{
		Process: &pb.ProcessConfig{Cmd: "/bin/sh", Envs: map[string]string{"PS1": "$ ", "TERM": "xterm"}},
		Pty:     &pb.PTY{Size: &pb.PTY_Size{Cols: 80, Rows: 24}},
	}
	s, pid := h.startStream(t, ctx, h.proc, as(h, "user", req))
	sel := &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: pid}}
	events := make(chan *pb.ProcessEvent, 256)
	go func() {
		defer close(events)
		for s.Receive() {
			events <- s.Msg().GetEvent()
		}
	}()
	var out strings.Builder
	var end *pb.ProcessEvent_EndEvent
	waitFor := func(want string) {
		t.Helper()
		deadline := time.After(10 * time.Second)
		for !strings.Contains(out.String(), want) {
			select {
			case ev, ok := <-events:
				if !ok {
					t.Fatalf("stream ended waiting for %q; output %q", want, out.String())
				}
				if d := ev.GetData(); d != nil {
					if d.GetStdout() != nil || d.GetStderr() != nil {
						t.Errorf("PTY process sent stdout/stderr, not pty data")
					}
					out.Write(d.GetPty())
				}
				if e := ev.GetEnd(); e != nil {
					end = e
				}
			case <-deadline:
				t.Fatalf("timed out waiting for %q; output %q", want, out.String())
			}
		}
	}
	input := func(s string) {
		t.Helper()
		if _, err := h.proc.SendInput(ctx, as(h, "", &pb.SendInputRequest{Process: sel, Input: &pb.ProcessInput{Input: &pb.ProcessInput_Pty{Pty: []byte(s)}}})); err != nil {
			t.Fatal(err)
		}
	}
	input("tty; /bin/busybox stty size; echo marker-$((6*7))\n")
	waitFor("marker-42")
	if !strings.Contains(out.String(), "/dev/pts/") || !strings.Contains(out.String(), "24 80") {
		t.Errorf("pty output lacks a tty or its size: %q", out.String())
	}
	if _, err := h.proc.Update(ctx, as(h, "", &pb.UpdateRequest{Process: sel, Pty: &pb.PTY{Size: &pb.PTY_Size{Cols: 100, Rows: 30}}})); err != nil {
		t.Fatal(err)
	}
	input("/bin/busybox stty size; echo resized-$((1+1))\n")
	waitFor("resized-2")
	if !strings.Contains(out.String(), "30 100") {
		t.Errorf("size after Update not seen: %q", out.String())
	}
	// Stdin-style calls are refused on a PTY.
	_, err := h.proc.SendInput(ctx, as(h, "", &pb.SendInputRequest{Process: sel, Input: &pb.ProcessInput{Input: &pb.ProcessInput_Stdin{Stdin: []byte("x")}}}))
	wantCode(t, "stdin to a PTY process", err, connect.CodeInvalidArgument)
	_, err = h.proc.CloseStdin(ctx, as(h, "", &pb.CloseStdinRequest{Process: sel}))
	wantCode(t, "CloseStdin on a PTY", err, connect.CodeInvalidArgument)
	input("exit 7\n")
	for ev := range events {
		if e := ev.GetEnd(); e != nil {
			end = e
		}
	}
	if end.GetExitCode() != 7 {
		t.Errorf("pty shell end: %s (stream err %v)", fmtEnd(end), s.Err())
	}
}

func (h *harness) testBackground(t *testing.T) {
	ctx := ctxT(t)
	tag := "bg-" + time.Now().Format("150405.000")
	req := &pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", "echo started; exec sleep 60"}}, Tag: &tag}
	startCtx, disconnect := context.WithCancel(ctx)
	s, pid := h.startStream(t, startCtx, h.proc, as(h, "", req))
	// The client goes away; the process must not.
	disconnect()
	s.Close()
	time.Sleep(100 * time.Millisecond)
	if got := h.listPIDs(t)[pid]; got != tag {
		t.Fatalf("background process %d not listed with tag %q after disconnect: %v", pid, tag, h.listPIDs(t))
	}
	res, err := h.proc.List(ctx, as(h, "", &pb.ListRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range res.Msg.GetProcesses() {
		if p.GetPid() == pid && (p.GetConfig().GetCmd() != "/bin/sh" || len(p.GetConfig().GetArgs()) != 2) {
			t.Errorf("listed config: %v", p.GetConfig())
		}
	}
	// Two clients reconnect, by tag and by pid; both see the end.
	byTag, err := h.proc.Connect(ctx, as(h, "", &pb.ConnectRequest{Process: &pb.ProcessSelector{Selector: &pb.ProcessSelector_Tag{Tag: tag}}}))
	if err != nil {
		t.Fatal(err)
	}
	byPID, err := h.procBin.Connect(ctx, as(h, "", &pb.ConnectRequest{Process: &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: pid}}}))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []*connect.ServerStreamForClient[pb.ConnectResponse]{byTag, byPID} {
		if !c.Receive() || c.Msg().GetEvent().GetStart().GetPid() != pid {
			t.Fatalf("connect: first event %v, err %v", c.Msg(), c.Err())
		}
	}
	if _, err := h.proc.SendSignal(ctx, as(h, "", &pb.SendSignalRequest{
		Process: &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: pid}}, Signal: pb.Signal_SIGNAL_SIGKILL,
	})); err != nil {
		t.Fatal(err)
	}
	for _, c := range []*connect.ServerStreamForClient[pb.ConnectResponse]{byTag, byPID} {
		r, err := collect(c, func() *pb.ProcessEvent { return c.Msg().GetEvent() })
		if err != nil || r.end.GetExitCode() != -1 || r.end.GetExited() || r.end.GetStatus() != "signal: killed" {
			t.Errorf("killed process end: %s %v", fmtEnd(r.end), err)
		}
	}
	if _, ok := h.listPIDs(t)[pid]; ok {
		t.Errorf("killed process still listed")
	}
	_, err = h.proc.SendSignal(ctx, as(h, "", &pb.SendSignalRequest{
		Process: &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: pid}}, Signal: pb.Signal_SIGNAL_SIGKILL,
	}))
	wantCode(t, "kill of a gone process", err, connect.CodeNotFound)
	_, err = h.proc.Connect(ctx, as(h, "", &pb.ConnectRequest{Process: &pb.ProcessSelector{Selector: &pb.ProcessSelector_Tag{Tag: tag}}}))
	if err == nil {
		c, _ := h.proc.Connect(ctx, as(h, "", &pb.ConnectRequest{Process: &pb.ProcessSelector{Selector: &pb.ProcessSelector_Tag{Tag: tag}}}))
		c.Receive()
		err = c.Err()
	}
	wantCode(t, "connect to a gone tag", err, connect.CodeNotFound)

	// SIGTERM reaches the whole group: the shell and its child.
	s2, pid2 := h.startStream(t, ctx, h.proc, as(h, "", sh("sleep 60 & sleep 60; echo unreachable")))
	if _, err := h.proc.SendSignal(ctx, as(h, "", &pb.SendSignalRequest{
		Process: &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: pid2}}, Signal: pb.Signal_SIGNAL_SIGTERM,
	})); err != nil {
		t.Fatal(err)
	}
	r, err := collect(s2, func() *pb.ProcessEvent { return s2.Msg().GetEvent() })
	if err != nil || r.end.GetStatus() != "signal: terminated" || r.stdout != "" {
		t.Errorf("SIGTERM: %s stdout %q %v", fmtEnd(r.end), r.stdout, err)
	}
}

func (h *harness) testKeepaliveAndTimeout(t *testing.T) {
	ctx := ctxT(t)
	req := as(h, "", sh("sleep 2.2"))
	req.Header().Set("Keepalive-Ping-Interval", "1")
	r, err := h.run(ctx, h.proc, req)
	if err != nil || r.keepalives < 1 || r.end.GetExitCode() != 0 {
		t.Errorf("keepalives %d, end %s, %v", r.keepalives, fmtEnd(r.end), err)
	}
	// The Connect deadline is the process's lifetime (commands.run's
	// timeoutMs): it ends the stream and kills the process.
	tctx, cancel := context.WithTimeout(ctx, 700*time.Millisecond)
	defer cancel()
	tag := "timeout-" + time.Now().Format("150405.000")
	treq := sh("sleep 60")
	treq.Tag = &tag
	_, err = h.run(tctx, h.proc, as(h, "", treq))
	wantCode(t, "process past its timeout", err, connect.CodeDeadlineExceeded)
	eventually(t, "timed-out process to be killed", func() bool {
		for _, tg := range h.listPIDs(t) {
			if tg == tag {
				return false
			}
		}
		return true
	})
}

func (h *harness) testStreamInput(t *testing.T) {
	ctx := ctxT(t)
	yes := true
	s, pid := h.startStream(t, ctx, h.procBin, as(h, "", &pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "cat"}, Stdin: &yes}))
	sel := &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: pid}}
	in := h.procBin.StreamInput(ctx)
	if h.token != "" {
		in.RequestHeader().Set("X-Access-Token", h.token)
	}
	msgs := []*pb.StreamInputRequest{
		{Event: &pb.StreamInputRequest_Start{Start: &pb.StreamInputRequest_StartEvent{Process: sel}}},
		{Event: &pb.StreamInputRequest_Data{Data: &pb.StreamInputRequest_DataEvent{Input: &pb.ProcessInput{Input: &pb.ProcessInput_Stdin{Stdin: []byte("abc")}}}}},
		{Event: &pb.StreamInputRequest_Keepalive{Keepalive: &pb.StreamInputRequest_KeepAlive{}}},
		{Event: &pb.StreamInputRequest_Data{Data: &pb.StreamInputRequest_DataEvent{Input: &pb.ProcessInput{Input: &pb.ProcessInput_Stdin{Stdin: []byte("def")}}}}},
	}
	for _, m := range msgs {
		if err := in.Send(m); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := in.CloseAndReceive(); err != nil {
		t.Fatalf("stream input: %v", err)
	}
	if _, err := h.procBin.CloseStdin(ctx, as(h, "", &pb.CloseStdinRequest{Process: sel})); err != nil {
		t.Fatal(err)
	}
	r, err := collect(s, func() *pb.ProcessEvent { return s.Msg().GetEvent() })
	if err != nil || r.stdout != "abcdef" {
		t.Errorf("stream input echoed %q, %v", r.stdout, err)
	}
	// Data before the start event is refused.
	bad := h.procBin.StreamInput(ctx)
	_ = bad.Send(msgs[1])
	_, err = bad.CloseAndReceive()
	wantCode(t, "stream input without start", err, connect.CodeInvalidArgument)
}

func (h *harness) testOrphan(t *testing.T) {
	start := time.Now()
	r, err := h.run(ctxT(t), h.proc, as(h, "", sh("sleep 30 & echo done")))
	if err != nil || r.stdout != "done\n" || r.end.GetExitCode() != 0 {
		t.Errorf("orphan: %q %s %v", r.stdout, fmtEnd(r.end), err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("end waited %s for a background child holding stdout", d)
	}
}

func (h *harness) testProcessErrors(t *testing.T) {
	ctx := ctxT(t)
	nopid := &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: 999999}}
	startErr := func(what string, req *connect.Request[pb.StartRequest], want connect.Code) {
		t.Helper()
		_, err := h.run(ctx, h.proc, req)
		wantCode(t, what, err, want)
	}
	startErr("empty cmd", as(h, "", &pb.StartRequest{Process: &pb.ProcessConfig{}}), connect.CodeInvalidArgument)
	startErr("no process", as(h, "", &pb.StartRequest{}), connect.CodeInvalidArgument)
	missing := "/does/not/exist"
	startErr("missing cwd", as(h, "", &pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "true", Cwd: &missing}}), connect.CodeInvalidArgument)
	startErr("missing binary", as(h, "", &pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "no-such-binary-xyz"}}), connect.CodeInvalidArgument)
	startErr("unknown user", as(h, "nobody-here", sh("true")), connect.CodeUnauthenticated)
	startErr("other user's home", as(h, "", &pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "true", Cwd: ptr("~root")}}), connect.CodeInvalidArgument)

	_, err := h.proc.SendInput(ctx, as(h, "", &pb.SendInputRequest{Process: nopid, Input: &pb.ProcessInput{Input: &pb.ProcessInput_Stdin{Stdin: []byte("x")}}}))
	wantCode(t, "input to unknown pid", err, connect.CodeNotFound)
	_, err = h.proc.SendInput(ctx, as(h, "", &pb.SendInputRequest{}))
	wantCode(t, "input without selector", err, connect.CodeInvalidArgument)
	_, err = h.proc.SendSignal(ctx, as(h, "", &pb.SendSignalRequest{Process: nopid}))
	wantCode(t, "unspecified signal", err, connect.CodeInvalidArgument)
	_, err = h.proc.Update(ctx, as(h, "", &pb.UpdateRequest{Process: nopid}))
	wantCode(t, "update unknown", err, connect.CodeNotFound)
	_, err = h.proc.CloseStdin(ctx, as(h, "", &pb.CloseStdinRequest{Process: &pb.ProcessSelector{Selector: &pb.ProcessSelector_Tag{Tag: "nope"}}}))
	wantCode(t, "close stdin of unknown tag", err, connect.CodeNotFound)

	// A running pipe process: no PTY to resize; stdin off means no stdin.
	tag := "err-" + time.Now().Format("150405.000")
	no := false
	s, pid := h.startStream(t, ctx, h.proc, as(h, "", &pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "sleep", Args: []string{"30"}}, Tag: &tag, Stdin: &no}))
	defer s.Close()
	sel := &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: pid}}
	_, err = h.proc.Update(ctx, as(h, "", &pb.UpdateRequest{Process: sel, Pty: &pb.PTY{Size: &pb.PTY_Size{Cols: 10, Rows: 10}}}))
	wantCode(t, "resize a pipe process", err, connect.CodeFailedPrecondition)
	_, err = h.proc.SendInput(ctx, as(h, "", &pb.SendInputRequest{Process: sel, Input: &pb.ProcessInput{Input: &pb.ProcessInput_Stdin{Stdin: []byte("x")}}}))
	wantCode(t, "stdin when started without", err, connect.CodeFailedPrecondition)
	_, err = h.proc.SendInput(ctx, as(h, "", &pb.SendInputRequest{Process: sel, Input: &pb.ProcessInput{Input: &pb.ProcessInput_Pty{Pty: []byte("x")}}}))
	wantCode(t, "pty input to a pipe process", err, connect.CodeInvalidArgument)
	_, err = h.run(ctx, h.proc, as(h, "", &pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "true"}, Tag: &tag}))
	wantCode(t, "duplicate tag", err, connect.CodeAlreadyExists)
	if _, err := h.proc.SendSignal(ctx, as(h, "", &pb.SendSignalRequest{Process: sel, Signal: pb.Signal_SIGNAL_SIGKILL})); err != nil {
		t.Fatal(err)
	}
	h.healthy(t)
}

func ptr[T any](v T) *T { return &v }
