package sandbox

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
)

// DefaultCommandTimeout is how long a command may run when its options
// name no Timeout, as in E2B's SDKs: at the deadline the agent kills it.
const DefaultCommandTimeout = 60 * time.Second

// Commands runs processes in the sandbox.
type Commands struct {
	s   *Sandbox
	rpc processconnect.ProcessClient
}

// RunOptions configure a command. A nil *RunOptions is the defaults.
type RunOptions struct {
	// Envs are added to the sandbox's environment.
	Envs map[string]string
	// Cwd is the working directory; default the user's home (or the
	// sandbox's default workdir).
	Cwd string
	// User runs the command as this Linux user; default the sandbox's
	// default user.
	User string
	// OnStdout and OnStderr receive the output as it comes, chunk by
	// chunk (chunks may split lines and UTF-8 sequences).
	OnStdout func(data string)
	OnStderr func(data string)
	// Stdin keeps the command's stdin open for SendStdin; without it
	// stdin is /dev/null.
	Stdin bool
	// Timeout is the command's lifetime: the agent kills it then;
	// default DefaultCommandTimeout, negative: none.
	Timeout time.Duration
	// Tag names the process for Commands.List.
	Tag string
}

func (o *RunOptions) orDefault() *RunOptions {
	if o == nil {
		return &RunOptions{}
	}
	return o
}

// CommandResult is what a finished command did.
type CommandResult struct {
	ExitCode int
	Stdout   string
	Stderr   string
	// Err is the agent's description of a failure ("exit status 3",
	// "signal: killed"); empty on success.
	Err string
}

// Run runs cmd with bash (bash -l -c cmd, as E2B's SDKs do) and waits for
// it to end. A non-zero exit returns the result and a *CommandExitError.
// When ctx ends first, the command is killed (its deadline is ctx's).
func (c *Commands) Run(ctx context.Context, cmd string, opts *RunOptions) (*CommandResult, error) {
	o := *opts.orDefault()
	h, err := c.start(ctx, ctx, bashCommand(cmd, &o), &o)
	if err != nil {
		return nil, err
	}
	return h.Wait(ctx)
}

// Start starts cmd with bash and returns once it runs; its output goes to
// the options' callbacks and the handle until it ends, Timeout passes or
// the handle disconnects. ctx bounds only the start.
func (c *Commands) Start(ctx context.Context, cmd string, opts *RunOptions) (*CommandHandle, error) {
	o := *opts.orDefault()
	return c.start(ctx, context.WithoutCancel(ctx), bashCommand(cmd, &o), &o)
}

func bashCommand(cmd string, o *RunOptions) *process.StartRequest {
	req := &process.StartRequest{
		Process: &process.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-l", "-c", cmd}, Envs: o.Envs},
		Stdin:   &o.Stdin,
	}
	if o.Cwd != "" {
		req.Process.Cwd = &o.Cwd
	}
	if o.Tag != "" {
		req.Tag = &o.Tag
	}
	return req
}

// start opens the Start stream under streamCtx and waits, under ctx,
// for the process's PID.
func (c *Commands) start(ctx, streamCtx context.Context, req *process.StartRequest, o *RunOptions) (*CommandHandle, error) {
	h := &CommandHandle{c: c, onStdout: o.OnStdout, onStderr: o.OnStderr}
	return openStream(ctx, streamCtx, o, "start command", h, c.rpc.Start, req)
}

// eventMessage is a stream message carrying a process event
// (StartResponse, ConnectResponse).
type eventMessage interface {
	GetEvent() *process.ProcessEvent
}

// openStream calls a process stream under streamCtx, bounded by the
// options' timeout (zero: DefaultCommandTimeout), and hands it to h.
// Until the start event, ctx's end aborts it too.
func openStream[Req any, Resp any, PResp interface {
	*Resp
	eventMessage
}](ctx, streamCtx context.Context, o *RunOptions, op string, h *CommandHandle,
	call func(context.Context, *connect.Request[Req]) (*connect.ServerStreamForClient[Resp], error), msg *Req,
) (*CommandHandle, error) {
	timeout := o.Timeout
	if timeout == 0 {
		timeout = DefaultCommandTimeout
	}
	var cancel context.CancelFunc
	if timeout > 0 {
		streamCtx, cancel = context.WithTimeout(streamCtx, timeout)
	} else {
		streamCtx, cancel = context.WithCancel(streamCtx)
	}
	stop := context.AfterFunc(ctx, cancel)
	defer stop()
	r := request(msg, o.User)
	keepalive(r.Header())
	stream, err := call(streamCtx, r)
	if err != nil {
		cancel()
		return nil, classify(op, err)
	}
	h.cancel, h.done = cancel, make(chan struct{})
	return h.begin(ctx, op, func() (*process.ProcessEvent, error) {
		if !stream.Receive() {
			if err := stream.Err(); err != nil {
				return nil, err
			}
			return nil, errEndOfStream
		}
		return PResp(stream.Msg()).GetEvent(), nil
	}, func() { _ = stream.Close() })
}

var errEndOfStream = errors.New("the agent closed the stream before the process ended")

// Connect attaches to a running process by PID: its output from now on
// goes to the options' OnStdout and OnStderr and the handle. The options'
// Timeout bounds the attachment (default none), not the process; the
// rest are ignored.
func (c *Commands) Connect(ctx context.Context, pid uint32, opts *RunOptions) (*CommandHandle, error) {
	o := *opts.orDefault()
	if o.Timeout == 0 {
		o.Timeout = -1 // attaching sets no lifetime
	}
	h := &CommandHandle{c: c, onStdout: o.OnStdout, onStderr: o.OnStderr}
	return openStream(ctx, context.WithoutCancel(ctx), &o, "connect to process", h, c.rpc.Connect,
		&process.ConnectRequest{Process: selector(pid)})
}

func selector(pid uint32) *process.ProcessSelector {
	return &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: pid}}
}

// ProcessInfo describes a running process.
type ProcessInfo struct {
	PID  uint32
	Tag  string
	Cmd  string
	Args []string
	Envs map[string]string
	Cwd  string
}

// List returns the processes the agent started that still run.
func (c *Commands) List(ctx context.Context) ([]ProcessInfo, error) {
	ctx, cancel := c.s.client.unaryContext(ctx)
	defer cancel()
	resp, err := c.rpc.List(ctx, connect.NewRequest(&process.ListRequest{}))
	if err != nil {
		return nil, classify("list processes", err)
	}
	var out []ProcessInfo
	for _, p := range resp.Msg.GetProcesses() {
		cfg := p.GetConfig()
		out = append(out, ProcessInfo{PID: p.GetPid(), Tag: p.GetTag(), Cmd: cfg.GetCmd(), Args: cfg.GetArgs(), Envs: cfg.GetEnvs(), Cwd: cfg.GetCwd()})
	}
	return out, nil
}

// Kill sends SIGKILL to the process's group. A process already gone is
// ErrNotFound.
func (c *Commands) Kill(ctx context.Context, pid uint32) error {
	return c.signal(ctx, pid, process.Signal_SIGNAL_SIGKILL)
}

// Terminate sends SIGTERM to the process's group.
func (c *Commands) Terminate(ctx context.Context, pid uint32) error {
	return c.signal(ctx, pid, process.Signal_SIGNAL_SIGTERM)
}

func (c *Commands) signal(ctx context.Context, pid uint32, sig process.Signal) error {
	ctx, cancel := c.s.client.unaryContext(ctx)
	defer cancel()
	_, err := c.rpc.SendSignal(ctx, connect.NewRequest(&process.SendSignalRequest{Process: selector(pid), Signal: sig}))
	return classify(fmt.Sprintf("signal process %d", pid), err)
}

// SendStdin writes data to the process's stdin (started with Stdin).
func (c *Commands) SendStdin(ctx context.Context, pid uint32, data []byte) error {
	return c.input(ctx, pid, &process.ProcessInput{Input: &process.ProcessInput_Stdin{Stdin: data}})
}

// CloseStdin closes the process's stdin (it reads EOF).
func (c *Commands) CloseStdin(ctx context.Context, pid uint32) error {
	ctx, cancel := c.s.client.unaryContext(ctx)
	defer cancel()
	_, err := c.rpc.CloseStdin(ctx, connect.NewRequest(&process.CloseStdinRequest{Process: selector(pid)}))
	return classify(fmt.Sprintf("close stdin of process %d", pid), err)
}

func (c *Commands) input(ctx context.Context, pid uint32, in *process.ProcessInput) error {
	ctx, cancel := c.s.client.unaryContext(ctx)
	defer cancel()
	_, err := c.rpc.SendInput(ctx, connect.NewRequest(&process.SendInputRequest{Process: selector(pid), Input: in}))
	return classify(fmt.Sprintf("send input to process %d", pid), err)
}

// CommandHandle is a started process: its PID, its output so far, and
// Wait for its end.
type CommandHandle struct {
	PID uint32

	c        *Commands
	cancel   context.CancelFunc
	onStdout func(string)
	onStderr func(string)
	onPty    func([]byte)
	done     chan struct{}

	mu             sync.Mutex
	stdout, stderr strings.Builder
	result         *CommandResult
	err            error
}

// begin reads the start event (under ctx) and then the rest in the
// background.
func (h *CommandHandle) begin(ctx context.Context, op string, next func() (*process.ProcessEvent, error), closeStream func()) (*CommandHandle, error) {
	type first struct {
		ev  *process.ProcessEvent
		err error
	}
	got := make(chan first, 1)
	go func() {
		for {
			ev, err := next()
			if err != nil || ev.GetKeepalive() == nil {
				got <- first{ev, err}
				return
			}
		}
	}()
	var f first
	select {
	case f = <-got:
	case <-ctx.Done():
		// Cancelling the stream ends the receive; the stream is closed
		// only after it returned (streams are not safe for concurrent use).
		h.cancel()
		<-got
		closeStream()
		return nil, classify(op, ctx.Err())
	}
	if f.err == nil && f.ev.GetStart() == nil {
		f.err = fmt.Errorf("the agent sent %T before the start event", f.ev.GetEvent())
	}
	if f.err != nil {
		h.cancel()
		closeStream()
		return nil, classify(op, f.err)
	}
	h.PID = f.ev.GetStart().GetPid()
	go h.read(next, closeStream)
	return h, nil
}

func (h *CommandHandle) read(next func() (*process.ProcessEvent, error), closeStream func()) {
	defer close(h.done)
	defer h.cancel()
	defer closeStream()
	for {
		ev, err := next()
		if err != nil {
			h.mu.Lock()
			h.err = classify(fmt.Sprintf("process %d", h.PID), err)
			h.mu.Unlock()
			return
		}
		switch e := ev.GetEvent().(type) {
		case *process.ProcessEvent_Data:
			h.data(e.Data)
		case *process.ProcessEvent_End:
			h.mu.Lock()
			h.result = &CommandResult{
				ExitCode: int(e.End.GetExitCode()), Stdout: h.stdout.String(), Stderr: h.stderr.String(), Err: e.End.GetError(),
			}
			h.mu.Unlock()
			return
		}
	}
}

func (h *CommandHandle) data(d *process.ProcessEvent_DataEvent) {
	switch out := d.GetOutput().(type) {
	case *process.ProcessEvent_DataEvent_Stdout:
		s := string(out.Stdout)
		h.mu.Lock()
		h.stdout.WriteString(s)
		h.mu.Unlock()
		if h.onStdout != nil {
			h.onStdout(s)
		}
	case *process.ProcessEvent_DataEvent_Stderr:
		s := string(out.Stderr)
		h.mu.Lock()
		h.stderr.WriteString(s)
		h.mu.Unlock()
		if h.onStderr != nil {
			h.onStderr(s)
		}
	case *process.ProcessEvent_DataEvent_Pty:
		if h.onPty != nil {
			h.onPty(out.Pty)
		}
	}
}

// Wait waits for the process to end and returns its result; a non-zero
// exit is a *CommandExitError along with the result. When ctx ends first
// it returns ctx's error and the process goes on.
func (h *CommandHandle) Wait(ctx context.Context) (*CommandResult, error) {
	select {
	case <-h.done:
	case <-ctx.Done():
		return nil, classify(fmt.Sprintf("wait for process %d", h.PID), ctx.Err())
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.result == nil {
		return nil, h.err
	}
	r := *h.result
	if r.ExitCode != 0 || r.Err != "" {
		return &r, &CommandExitError{CommandResult: r}
	}
	return &r, nil
}

// Done is closed when the output stream ends (the process ended, the
// stream's timeout passed, or Disconnect).
func (h *CommandHandle) Done() <-chan struct{} { return h.done }

// Stdout returns the standard output received so far.
func (h *CommandHandle) Stdout() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.stdout.String()
}

// Stderr returns the standard error received so far.
func (h *CommandHandle) Stderr() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.stderr.String()
}

// Disconnect stops receiving output; the process goes on (Connect
// attaches again).
func (h *CommandHandle) Disconnect() { h.cancel() }

// Kill kills the process (SIGKILL to its group).
func (h *CommandHandle) Kill(ctx context.Context) error { return h.c.Kill(ctx, h.PID) }

// SendStdin writes data to the process's stdin.
func (h *CommandHandle) SendStdin(ctx context.Context, data []byte) error {
	return h.c.SendStdin(ctx, h.PID, data)
}

// CloseStdin closes the process's stdin.
func (h *CommandHandle) CloseStdin(ctx context.Context) error { return h.c.CloseStdin(ctx, h.PID) }

// Pty runs interactive shells on pseudo-terminals.
type Pty struct {
	s   *Sandbox
	rpc processconnect.ProcessClient
}

// PtyOptions configure a terminal. Cols and Rows are required.
type PtyOptions struct {
	Cols, Rows uint32
	// OnData receives the terminal's output.
	OnData func(data []byte)
	// Envs are added to the environment (TERM=xterm-256color,
	// LANG=LC_ALL=C.UTF-8 unless set).
	Envs map[string]string
	Cwd  string
	User string
	// Timeout is the shell's lifetime; default DefaultCommandTimeout,
	// negative: none.
	Timeout time.Duration
}

// Create starts an interactive login shell (bash -i -l) on a new
// terminal. Write to it with SendInput; it ends when the shell exits
// (send "exit\n") or is killed.
func (p *Pty) Create(ctx context.Context, opts PtyOptions) (*CommandHandle, error) {
	if opts.Cols == 0 || opts.Rows == 0 {
		return nil, fmt.Errorf("create pty: Cols and Rows are required: %w", ErrInvalidArgument)
	}
	envs := map[string]string{"TERM": "xterm-256color", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
	for k, v := range opts.Envs {
		envs[k] = v
	}
	req := &process.StartRequest{
		Process: &process.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-i", "-l"}, Envs: envs},
		Pty:     &process.PTY{Size: &process.PTY_Size{Cols: opts.Cols, Rows: opts.Rows}},
	}
	if opts.Cwd != "" {
		req.Process.Cwd = &opts.Cwd
	}
	c := p.s.Commands
	h := &CommandHandle{c: c, onPty: opts.OnData}
	return openStream(ctx, context.WithoutCancel(ctx), &RunOptions{User: opts.User, Timeout: opts.Timeout}, "create pty", h, c.rpc.Start, req)
}

// SendInput writes data to the terminal of process pid.
func (p *Pty) SendInput(ctx context.Context, pid uint32, data []byte) error {
	return p.s.Commands.input(ctx, pid, &process.ProcessInput{Input: &process.ProcessInput_Pty{Pty: data}})
}

// Resize changes the terminal's size (the shell gets SIGWINCH).
func (p *Pty) Resize(ctx context.Context, pid uint32, cols, rows uint32) error {
	ctx, cancel := p.s.client.unaryContext(ctx)
	defer cancel()
	_, err := p.rpc.Update(ctx, connect.NewRequest(&process.UpdateRequest{
		Process: selector(pid), Pty: &process.PTY{Size: &process.PTY_Size{Cols: cols, Rows: rows}},
	}))
	return classify(fmt.Sprintf("resize pty of process %d", pid), err)
}

// Kill kills the terminal's process.
func (p *Pty) Kill(ctx context.Context, pid uint32) error { return p.s.Commands.Kill(ctx, pid) }
