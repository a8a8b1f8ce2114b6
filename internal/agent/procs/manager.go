// Package procs runs and tracks the processes that envd clients start:
// pipes or a PTY, stdin, signals, resize, fan-out of output to any number
// of connected streams, and an exit status that always reaches them.
//
// Processes are started through a Starter (the agent's initproc.Reaper), so
// the agent as PID 1 stays the only waiter of its children; see
// initproc's package comment for why cmd.Wait must never be used here.
package procs

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	pb "github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/internal/agent/identity"
	"github.com/cubesandbox/cube/internal/agent/initproc"
	"github.com/cubesandbox/cube/internal/agent/logring"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
)

// FailpointStart fails a start after its pipes or PTY exist, before the
// fork: tests prove the half-built stdio is released.
const FailpointStart = "agent/process.start"

// Starter starts a command and owns waiting for it (initproc.Reaper).
type Starter interface {
	Start(cmd *exec.Cmd) (*initproc.Process, error)
}

// Manager is the registry of running processes, by PID and by tag.
//
// Invariant: a Proc is in procs (and in tags when tagged) from the moment
// it started until its exit has been collected and its output drained; it
// is removed before its end event is published, so a client that saw the
// end never finds it in List.
type Manager struct {
	starter Starter
	log     *slog.Logger
	// out keeps the output lines of pipe processes (the sandbox's log);
	// nil = none.
	out *logring.Ring

	mu    sync.Mutex
	procs map[uint32]*Proc
	tags  map[string]*Proc
}

// NewManager returns a Manager starting processes through s.
func NewManager(s Starter, log *slog.Logger) *Manager {
	if log == nil {
		log = slog.Default()
	}
	return &Manager{starter: s, log: log, procs: map[uint32]*Proc{}, tags: map[string]*Proc{}}
}

// KeepOutput makes the manager add every pipe process's output lines to
// r (the sandbox's log, GET /_cube/logs). PTY output is a terminal's
// screen, not lines, and is not kept.
func (m *Manager) KeepOutput(r *logring.Ring) { m.out = r }

// StartOptions says what to run and as whom.
type StartOptions struct {
	Config  *pb.ProcessConfig
	User    *identity.User
	Workdir string            // default cwd when Config has none ("" = home)
	Env     map[string]string // sandbox-wide variables (from /init)
	PTY     *pb.PTY           // nil: pipes
	Tag     string
	Stdin   bool
	// Timeout kills the process (SIGKILL to its group) after this long;
	// zero means never.
	Timeout time.Duration
}

// Start runs a process and returns it with a subscription already attached,
// so the caller sees all of its output from the first byte.
func (m *Manager) Start(o StartOptions) (*Proc, *Subscription, error) {
	cfg := o.Config
	if cfg == nil || cfg.GetCmd() == "" {
		return nil, nil, fmt.Errorf("process.cmd is required: %w", errdefs.ErrInvalidArgument)
	}
	if o.User == nil {
		return nil, nil, fmt.Errorf("no user: %w", errdefs.ErrUnauthenticated)
	}
	cwd, err := o.User.Resolve(cfg.GetCwd(), o.Workdir)
	if err != nil {
		return nil, nil, err
	}
	if st, err := os.Stat(cwd); err != nil || !st.IsDir() {
		return nil, nil, fmt.Errorf("cwd %q does not exist or is not a directory: %w", cwd, errdefs.ErrInvalidArgument)
	}
	env := buildEnv(o.User, o.Env, cfg.GetEnvs())
	path, err := lookPath(cfg.GetCmd(), env)
	if err != nil {
		return nil, nil, err
	}
	m.mu.Lock()
	if o.Tag != "" && m.tags[o.Tag] != nil {
		m.mu.Unlock()
		return nil, nil, fmt.Errorf("a process tagged %q is already running: %w", o.Tag, errdefs.ErrAlreadyExists)
	}
	m.mu.Unlock()

	cmd := &exec.Cmd{
		Path: path,
		Args: append([]string{cfg.GetCmd()}, cfg.GetArgs()...),
		Env:  env,
		Dir:  cwd,
		SysProcAttr: &syscall.SysProcAttr{
			Setsid: true,
			Credential: &syscall.Credential{
				Uid: o.User.UID, Gid: o.User.GID, Groups: slices.Clone(o.User.Groups),
			},
		},
	}
	if err := checkPTYSize(o.PTY); err != nil {
		return nil, nil, err
	}
	p := &Proc{Tag: o.Tag, Config: cfg, subs: map[*Subscription]struct{}{}, closed: make(chan struct{})}
	pio, err := p.prepareIO(cmd, o)
	if err != nil {
		return nil, nil, err
	}
	sub, _ := p.Subscribe()

	m.mu.Lock()
	if o.Tag != "" && m.tags[o.Tag] != nil { // lost a race for the tag
		m.mu.Unlock()
		pio.abort()
		return nil, nil, fmt.Errorf("a process tagged %q is already running: %w", o.Tag, errdefs.ErrAlreadyExists)
	}
	err = failpoint.Eval(context.Background(), FailpointStart)
	var rp *initproc.Process
	if err == nil {
		rp, err = m.starter.Start(cmd)
	}
	if err != nil {
		m.mu.Unlock()
		pio.abort()
		return nil, nil, fmt.Errorf("start %q in %s as %s: %w: %w", cfg.GetCmd(), cwd, o.User.Name, err, errdefs.ErrInvalidArgument)
	}
	p.PID, p.proc = uint32(rp.Pid), rp
	if m.out != nil && !p.isPTY {
		tmpl := agentproto.LogEntry{Source: agentproto.LogSourceProcess, PID: p.PID, Cmd: cfg.GetCmd()}
		tmpl.Stream = "stdout"
		p.logOut = m.out.Writer(tmpl)
		tmpl.Stream = "stderr"
		p.logErr = m.out.Writer(tmpl)
	}
	m.procs[p.PID] = p
	if o.Tag != "" {
		m.tags[o.Tag] = p
	}
	m.mu.Unlock()
	pio.started()

	m.log.Info("process started", "pid", p.PID, "cmd", cfg.GetCmd(), "user", o.User.Name, "pty", o.PTY != nil, "tag", o.Tag)
	go m.supervise(p, pio, o.Timeout)
	return p, sub, nil
}

// supervise waits for the exit, drains the output, unregisters the process
// and publishes its end.
func (m *Manager) supervise(p *Proc, pio *procIO, timeout time.Duration) {
	var killer *time.Timer
	if timeout > 0 {
		killer = time.AfterFunc(timeout, func() {
			m.log.Info("process timed out; killing", "pid", p.PID, "timeout", timeout)
			_ = p.Signal(unix.SIGKILL)
		})
	}
	exit := p.proc.Wait()
	if killer != nil {
		killer.Stop()
	}
	deadline := time.Now().Add(drainGrace)
	for _, r := range pio.readers {
		_ = r.SetReadDeadline(deadline)
	}
	pio.wg.Wait()
	p.closeIO(pio.readers)
	for _, w := range []*logring.Writer{p.logOut, p.logErr} {
		if w != nil {
			w.Flush()
		}
	}

	m.mu.Lock()
	delete(m.procs, p.PID)
	if p.Tag != "" && m.tags[p.Tag] == p {
		delete(m.tags, p.Tag)
	}
	m.mu.Unlock()
	end := endEvent(exit)
	m.log.Info("process ended", "pid", p.PID, "status", end.GetStatus())
	p.finish(end)
}

// Get finds a running process by selector.
func (m *Manager) Get(sel *pb.ProcessSelector) (*Proc, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	switch s := sel.GetSelector().(type) {
	case *pb.ProcessSelector_Pid:
		if p := m.procs[s.Pid]; p != nil {
			return p, nil
		}
		return nil, fmt.Errorf("process with pid %d: %w", s.Pid, errdefs.ErrNotFound)
	case *pb.ProcessSelector_Tag:
		if p := m.tags[s.Tag]; p != nil {
			return p, nil
		}
		return nil, fmt.Errorf("process with tag %q: %w", s.Tag, errdefs.ErrNotFound)
	}
	return nil, fmt.Errorf("process selector needs a pid or a tag: %w", errdefs.ErrInvalidArgument)
}

// List returns the running processes, ordered by PID.
func (m *Manager) List() []*Proc {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := slices.Collect(maps.Values(m.procs))
	slices.SortFunc(out, func(a, b *Proc) int { return int(a.PID) - int(b.PID) })
	return out
}

// procIO is the parent's side of a process's stdio while it is starting.
type procIO struct {
	readers   []*os.File // stdout, stderr or the PTY master
	childEnds []*os.File // closed in the parent once the child has them
	wg        sync.WaitGroup
	p         *Proc
	pumps     []func()
}

func (p *Proc) prepareIO(cmd *exec.Cmd, o StartOptions) (*procIO, error) {
	pio := &procIO{p: p}
	if o.PTY != nil {
		size := o.PTY.GetSize()
		master, slave, err := openPTY(uint16(size.GetCols()), uint16(size.GetRows()))
		if err != nil {
			return nil, err
		}
		cmd.Stdin, cmd.Stdout, cmd.Stderr = slave, slave, slave
		cmd.SysProcAttr.Setctty = true
		cmd.SysProcAttr.Ctty = 0 // the child's fd 0
		p.pty, p.isPTY = master, true
		pio.readers = []*os.File{master}
		pio.childEnds = []*os.File{slave}
		pio.pumps = []func(){func() {
			p.pump(master, ptyChunk, func(b []byte) *pb.ProcessEvent_DataEvent {
				return &pb.ProcessEvent_DataEvent{Output: &pb.ProcessEvent_DataEvent_Pty{Pty: b}}
			})
		}}
		return pio, nil
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		outR.Close()
		outW.Close()
		return nil, err
	}
	cmd.Stdout, cmd.Stderr = outW, errW
	pio.readers = []*os.File{outR, errR}
	pio.childEnds = []*os.File{outW, errW}
	if o.Stdin {
		inR, inW, err := os.Pipe()
		if err != nil {
			pio.abort()
			return nil, err
		}
		cmd.Stdin = inR
		p.stdin = inW
		pio.childEnds = append(pio.childEnds, inR)
	} // else nil: exec gives the child /dev/null
	pio.pumps = []func(){
		func() {
			p.pump(outR, pipeChunk, func(b []byte) *pb.ProcessEvent_DataEvent {
				p.keep(p.logOut, b)
				return &pb.ProcessEvent_DataEvent{Output: &pb.ProcessEvent_DataEvent_Stdout{Stdout: b}}
			})
		},
		func() {
			p.pump(errR, pipeChunk, func(b []byte) *pb.ProcessEvent_DataEvent {
				p.keep(p.logErr, b)
				return &pb.ProcessEvent_DataEvent{Output: &pb.ProcessEvent_DataEvent_Stderr{Stderr: b}}
			})
		},
	}
	return pio, nil
}

// started closes the child's ends in the parent (so EOF arrives when the
// child and its descendants close theirs) and starts reading.
func (pio *procIO) started() {
	for _, f := range pio.childEnds {
		f.Close()
	}
	for _, pump := range pio.pumps {
		pio.wg.Go(pump)
	}
}

// abort releases everything when the process never started.
func (pio *procIO) abort() {
	for _, f := range pio.childEnds {
		f.Close()
	}
	for _, f := range pio.readers {
		f.Close()
	}
	if pio.p.stdin != nil {
		pio.p.stdin.Close()
		pio.p.stdin = nil
	}
	pio.p.pty = nil
}

// checkPTYSize refuses sizes a terminal cannot have (winsize is 16-bit).
func checkPTYSize(p *pb.PTY) error {
	if p == nil {
		return nil
	}
	if c, r := p.GetSize().GetCols(), p.GetSize().GetRows(); c > 0xffff || r > 0xffff {
		return fmt.Errorf("pty size %dx%d is too large: %w", c, r, errdefs.ErrInvalidArgument)
	}
	return nil
}

// buildEnv is envd's order: PATH from the agent, the user's identity, the
// sandbox-wide variables, then the request's; later entries win.
func buildEnv(u *identity.User, defaults, req map[string]string) []string {
	env := []string{
		"PATH=" + os.Getenv("PATH"),
		"HOME=" + u.Home,
		"USER=" + u.Name,
		"LOGNAME=" + u.Name,
	}
	for _, k := range slices.Sorted(maps.Keys(defaults)) {
		env = append(env, k+"="+defaults[k])
	}
	for _, k := range slices.Sorted(maps.Keys(req)) {
		env = append(env, k+"="+req[k])
	}
	return dedupEnv(env)
}

// dedupEnv keeps the last value of each key, in first-seen order.
func dedupEnv(env []string) []string {
	idx := map[string]int{}
	var out []string
	for _, kv := range env {
		k, _, _ := strings.Cut(kv, "=")
		if i, ok := idx[k]; ok {
			out[i] = kv
			continue
		}
		idx[k] = len(out)
		out = append(out, kv)
	}
	return out
}

// lookPath resolves cmd against the PATH the process itself will have (a
// request may set its own), not the agent's.
func lookPath(cmd string, env []string) (string, error) {
	if strings.Contains(cmd, "/") {
		return cmd, nil
	}
	path := ""
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			path = v
		}
	}
	for _, dir := range filepath.SplitList(path) {
		if dir == "" {
			dir = "."
		}
		p := filepath.Join(dir, cmd)
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("executable %q not found in PATH %q: %w", cmd, path, errdefs.ErrInvalidArgument)
}
