package launcher

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"

	"github.com/cubesandbox/cube/internal/forkthread"
)

// child is one supervised daemon: started, restarted with backoff when it
// dies on its own, stopped with SIGTERM (then SIGKILL) on shutdown.
type child struct {
	name string
	path string
	args []string
	env  []string
	out  io.Writer // the daemon's stdout and stderr
	log  *slog.Logger

	mu      sync.Mutex
	cmd     *exec.Cmd
	exited  chan struct{}
	stopped bool
}

func (c *child) start() error {
	cmd := exec.Command(c.path, c.args...)
	cmd.Env = append(os.Environ(), c.env...)
	cmd.Stdout, cmd.Stderr = c.out, c.out
	// Own process group (a Ctrl-C on the terminal reaches only the
	// launcher, which stops the children in order), and SIGTERM should the
	// launcher die without doing so.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	if err := onForkThread(cmd.Start); err != nil {
		return fmt.Errorf("start %s: %w", c.name, err)
	}
	exited := make(chan struct{})
	c.mu.Lock()
	c.cmd, c.exited = cmd, exited
	c.mu.Unlock()
	go func() { _ = cmd.Wait(); close(exited) }()
	c.log.Info("started", "daemon", c.name, "pid", cmd.Process.Pid)
	return nil
}

// onForkThread runs start on the process's fork thread: the kernel sends
// the parent-death signal when the thread that forked the child exits
// (internal/forkthread), and tests run Up in their own processes.
func onForkThread(start func() error) error { return forkthread.Do(start) }

// supervise restarts the child whenever it exits until ctx ends.
func (c *child) supervise(ctx context.Context) {
	backoff := time.Second
	for {
		c.mu.Lock()
		exited, cmd := c.exited, c.cmd
		c.mu.Unlock()
		started := time.Now()
		select {
		case <-ctx.Done():
			return
		case <-exited:
		}
		c.mu.Lock()
		stopped := c.stopped
		c.mu.Unlock()
		if stopped || ctx.Err() != nil {
			return
		}
		if time.Since(started) > time.Minute {
			backoff = time.Second
		}
		c.log.Warn("daemon exited; restarting", "daemon", c.name, "status", cmd.ProcessState.String(), "in", backoff)
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 30*time.Second)
		if err := c.start(); err != nil {
			c.log.Error("restart failed", "daemon", c.name, "err", err)
		}
	}
}

// stop sends SIGTERM and waits up to grace before SIGKILL.
func (c *child) stop(grace time.Duration) {
	c.mu.Lock()
	c.stopped = true
	cmd, exited := c.cmd, c.exited
	c.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-exited:
	case <-time.After(grace):
		c.log.Warn("daemon did not stop in time; killing it", "daemon", c.name)
		_ = cmd.Process.Kill()
		<-exited
	}
	c.log.Info("stopped", "daemon", c.name)
}

// prefixWriter writes each line with a prefix (the daemon's name), so the
// launcher's terminal shows who said what. Writes of whole lines only
// (slog handlers write one line per record) keep lines intact.
type prefixWriter struct {
	mu     sync.Mutex
	w      io.Writer
	prefix []byte
	buf    []byte
}

func (p *prefixWriter) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.buf = append(p.buf, b...)
	for {
		i := bytes.IndexByte(p.buf, '\n')
		if i < 0 {
			break
		}
		line := append(append([]byte{}, p.prefix...), p.buf[:i+1]...)
		if _, err := p.w.Write(line); err != nil {
			return len(b), err
		}
		p.buf = p.buf[i+1:]
	}
	return len(b), nil
}
