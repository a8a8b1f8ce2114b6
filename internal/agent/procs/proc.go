package procs

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	pb "github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/internal/agent/initproc"
	"github.com/cubesandbox/cube/internal/agent/logring"
	"github.com/cubesandbox/cube/internal/errdefs"
)

const (
	pipeChunk = 32 << 10
	ptyChunk  = 16 << 10
	// subBuffer is how many events a slow subscriber may lag behind
	// before the process's output blocks on it (back-pressure, never an
	// unbounded queue).
	subBuffer = 64
	// drainGrace bounds how long output is still read after the process
	// exited: a background child that inherited stdout ("sleep 100 &")
	// keeps the pipe open, and the end event must not wait for it.
	drainGrace = 100 * time.Millisecond
	// writeTimeout bounds a write to a stdin nobody reads.
	writeTimeout = 10 * time.Second
)

// Event is one thing a subscriber of a process receives: a chunk of output
// or, last, the end.
type Event struct {
	Data *pb.ProcessEvent_DataEvent
	End  *pb.ProcessEvent_EndEvent
}

// Proc is a process started through a Manager.
//
// Lifecycle: Manager.Start registers it and returns it running; output is
// published to the current subscribers as it is read; when the process has
// exited and its output is drained, it is unregistered, every subscriber
// gets the end event, and Done is closed. A process outlives every client
// connection: only its own exit, a signal, or its timeout ends it.
type Proc struct {
	PID    uint32
	Tag    string
	Config *pb.ProcessConfig

	proc *initproc.Process

	mu     sync.Mutex
	subs   map[*Subscription]struct{}
	end    *pb.ProcessEvent_EndEvent // set once output is drained and it exited
	stdin  *os.File                  // nil when disabled or closed
	pty    *os.File                  // the master, nil for pipe processes
	isPTY  bool
	closed chan struct{}
	// logOut and logErr keep the output in the sandbox's log (nil: not
	// kept); set before the pumps start.
	logOut, logErr *logring.Writer
}

// keep adds output to the sandbox's log.
func (p *Proc) keep(w *logring.Writer, b []byte) {
	if w != nil {
		_, _ = w.Write(b)
	}
}

// Subscription receives a process's events from the moment it was made.
type Subscription struct {
	C    <-chan Event
	ch   chan Event
	gone chan struct{}
	once sync.Once
	p    *Proc
}

// Close stops the subscription; the process keeps running.
func (s *Subscription) Close() {
	s.once.Do(func() {
		s.p.mu.Lock()
		delete(s.p.subs, s)
		s.p.mu.Unlock()
		close(s.gone)
	})
}

// Subscribe attaches a new subscriber. If the process has already ended,
// it returns nil and the end event instead.
func (p *Proc) Subscribe() (*Subscription, *pb.ProcessEvent_EndEvent) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.end != nil {
		return nil, p.end
	}
	ch := make(chan Event, subBuffer)
	s := &Subscription{C: ch, ch: ch, gone: make(chan struct{}), p: p}
	p.subs[s] = struct{}{}
	return s, nil
}

// Done is closed once the end event has been published.
func (p *Proc) Done() <-chan struct{} { return p.closed }

// IsPTY reports whether the process runs on a pseudo-terminal.
func (p *Proc) IsPTY() bool { return p.isPTY }

func (p *Proc) publish(ev Event) {
	p.mu.Lock()
	subs := make([]*Subscription, 0, len(p.subs))
	for s := range p.subs {
		subs = append(subs, s)
	}
	p.mu.Unlock()
	for _, s := range subs {
		select {
		case s.ch <- ev:
		case <-s.gone:
		}
	}
}

// finish records the end and hands it to every subscriber; Subscribe after
// this returns the end directly.
func (p *Proc) finish(end *pb.ProcessEvent_EndEvent) {
	p.mu.Lock()
	p.end = end
	subs := make([]*Subscription, 0, len(p.subs))
	for s := range p.subs {
		subs = append(subs, s)
	}
	p.mu.Unlock()
	for _, s := range subs {
		select {
		case s.ch <- Event{End: end}:
		case <-s.gone:
		}
	}
	close(p.closed)
}

// pump reads one output stream until EOF, an error, or the drain deadline.
func (p *Proc) pump(r *os.File, chunk int, wrap func([]byte) *pb.ProcessEvent_DataEvent) {
	for {
		buf := make([]byte, chunk)
		n, err := r.Read(buf)
		if n > 0 {
			p.publish(Event{Data: wrap(buf[:n])})
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			p.drainNow(r, chunk, wrap)
			return
		}
		if err != nil {
			// EOF, or EIO from a PTY whose last slave closed: there is
			// nothing more to read.
			return
		}
	}
}

// drainNow publishes what is already buffered in r once the drain
// deadline has passed. The deadline can wake a blocked Read before the
// poller reports data the process wrote just before it exited (a loaded
// node, or gVisor's slower epoll), and Read then returns without trying
// the descriptor again: the output of `echo x` would be lost. Reads here
// go straight to the (non-blocking) descriptor until it is empty, and
// never wait.
func (p *Proc) drainNow(r *os.File, chunk int, wrap func([]byte) *pb.ProcessEvent_DataEvent) {
	rc, err := r.SyscallConn()
	if err != nil {
		return
	}
	for {
		buf := make([]byte, chunk)
		var n int
		var rerr error
		if err := rc.Control(func(fd uintptr) { n, rerr = unix.Read(int(fd), buf) }); err != nil {
			return
		}
		if n <= 0 || rerr != nil {
			return // empty (EAGAIN), EOF or an error
		}
		p.publish(Event{Data: wrap(buf[:n])})
	}
}

// Signal sends sig to the process's group (it leads its own session, so
// this reaches the children it started too) or, failing that, to it alone.
func (p *Proc) Signal(sig unix.Signal) error {
	select {
	case <-p.proc.Done():
		// Reaped: the PID may already belong to someone else.
		return fmt.Errorf("process %d has exited: %w", p.PID, errdefs.ErrNotFound)
	default:
	}
	err := unix.Kill(-int(p.PID), sig)
	if errors.Is(err, unix.ESRCH) {
		err = unix.Kill(int(p.PID), sig)
	}
	if errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("process %d has exited: %w", p.PID, errdefs.ErrNotFound)
	}
	return err
}

// WriteStdin writes to the process's stdin pipe.
func (p *Proc) WriteStdin(data []byte) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.isPTY {
		return fmt.Errorf("process %d runs on a PTY: send pty input instead of stdin: %w", p.PID, errdefs.ErrInvalidArgument)
	}
	if p.stdin == nil {
		return fmt.Errorf("process %d has no stdin (started without stdin, or closed): %w", p.PID, errdefs.ErrFailedPrecondition)
	}
	return writeAll(p.stdin, data)
}

// WritePTY writes to the process's terminal, as typed input.
func (p *Proc) WritePTY(data []byte) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.isPTY || p.pty == nil {
		return fmt.Errorf("process %d has no PTY: send stdin instead: %w", p.PID, errdefs.ErrInvalidArgument)
	}
	return writeAll(p.pty, data)
}

func writeAll(f *os.File, data []byte) error {
	_ = f.SetWriteDeadline(time.Now().Add(writeTimeout))
	_, err := f.Write(data)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return fmt.Errorf("input not consumed within %s: %w", writeTimeout, errdefs.ErrResourceExhausted)
	}
	if errors.Is(err, os.ErrClosed) || errors.Is(err, unix.EPIPE) {
		return fmt.Errorf("input closed: %w", errdefs.ErrFailedPrecondition)
	}
	return err
}

// CloseStdin closes the stdin pipe: the process reads EOF. Closing twice
// is harmless.
func (p *Proc) CloseStdin() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.isPTY {
		return fmt.Errorf("process %d runs on a PTY: send Ctrl-D (0x04) instead: %w", p.PID, errdefs.ErrInvalidArgument)
	}
	if p.stdin == nil {
		return nil
	}
	err := p.stdin.Close()
	p.stdin = nil
	return err
}

// Resize changes the PTY's window size.
func (p *Proc) Resize(cols, rows uint16) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.isPTY || p.pty == nil {
		return fmt.Errorf("process %d has no PTY to resize: %w", p.PID, errdefs.ErrFailedPrecondition)
	}
	if cols == 0 || rows == 0 {
		return fmt.Errorf("pty size %dx%d: %w", cols, rows, errdefs.ErrInvalidArgument)
	}
	return setSize(p.pty, cols, rows)
}

// closeIO releases the parent's ends once the process is gone.
func (p *Proc) closeIO(readers []*os.File) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, r := range readers {
		if r != p.pty {
			r.Close()
		}
	}
	if p.pty != nil {
		p.pty.Close()
		p.pty = nil
	}
	if p.stdin != nil {
		p.stdin.Close()
		p.stdin = nil
	}
}

// endEvent describes an exit the way envd (Go's os.ProcessState) does.
func endEvent(e initproc.Exit) *pb.ProcessEvent_EndEvent {
	ws := e.Status
	ev := &pb.ProcessEvent_EndEvent{}
	switch {
	case ws.Exited():
		ev.ExitCode = int32(ws.ExitStatus())
		ev.Exited = true
		ev.Status = fmt.Sprintf("exit status %d", ws.ExitStatus())
	case ws.Signaled():
		ev.ExitCode = -1
		ev.Status = "signal: " + ws.Signal().String()
		if ws.CoreDump() {
			ev.Status += " (core dumped)"
		}
	default:
		ev.ExitCode = -1
		ev.Status = fmt.Sprintf("wait status %#x", uint32(ws))
	}
	if !ev.Exited || ev.ExitCode != 0 {
		msg := ev.Status
		ev.Error = &msg
	}
	return ev
}
