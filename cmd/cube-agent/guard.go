package main

import (
	"fmt"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// protectSelf makes the agent non-dumpable. Code in the sandbox, root
// included, then cannot open the agent's /proc/<pid>/fd/* (its stdout is
// the sandbox's console file on the host), environ or mem, nor ptrace it,
// unless it holds CAP_SYS_PTRACE, which no sandbox gets: the kernel's
// ptrace access check refuses non-dumpable targets. Children the agent
// starts are dumpable again after their exec, as usual.
func protectSelf() error {
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		return fmt.Errorf("prctl(PR_SET_DUMPABLE, 0): %w", err)
	}
	return nil
}

// consoleMax bounds what the agent writes to its stderr: in a container
// that is a file on the host (the runtime's console.log) which nothing
// else rotates. A sandbox can make the agent log (failed requests, each
// a line), so without a bound it could grow that file without end.
const (
	consoleMax  = 1 << 20  // bytes the console file may reach
	consoleKeep = 64 << 10 // newest bytes written again after a truncation
)

// cappedConsole keeps the agent's console output below max bytes. On a
// regular file it truncates the file when the next write would pass max
// and writes the newest keep bytes (kept in memory) again after a marker,
// like a ring; elsewhere (a pipe, a VM's serial console: rings of their
// own or bounded by a reader) it writes through.
type cappedConsole struct {
	mu        sync.Mutex
	f         *os.File
	max, keep int
	size      int64  // bytes in the file, as far as this writer knows
	tail      []byte // the newest keep bytes written
	file      bool   // f is a regular file that can be truncated
	stopped   bool   // truncation failed or detached: nothing more is written
}

func newCappedConsole(f *os.File, limit, keep int) *cappedConsole {
	c := &cappedConsole{f: f, max: limit, keep: keep}
	if st, err := f.Stat(); err == nil && st.Mode().IsRegular() {
		c.file, c.size = true, st.Size()
	}
	return c
}

func (c *cappedConsole) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stopped {
		return len(p), nil
	}
	if !c.file {
		return c.f.Write(p)
	}
	if c.size+int64(len(p)) > int64(c.max) {
		c.truncate()
	}
	if c.stopped {
		return len(p), nil
	}
	n, err := c.f.Write(p)
	c.size += int64(n)
	c.remember(p[:n])
	return n, err
}

// truncate empties the file and writes back the marker and the kept
// tail. A file that cannot be truncated (a runtime that hands the agent
// a descriptor without that right) is written to no more: the bound
// matters more than the newest lines.
func (c *cappedConsole) truncate() {
	if err := c.f.Truncate(0); err != nil {
		_, _ = fmt.Fprintf(c.f, "cube-agent: console reached %d bytes and cannot be truncated (%v); nothing more is written\n", c.max, err)
		c.stopped = true
		return
	}
	// The runtimes open the console O_APPEND; without it the offset
	// must follow the new end.
	_, _ = c.f.Seek(0, 0)
	marker := fmt.Sprintf("cube-agent: console reached %d bytes; truncated, the newest %d bytes follow\n", c.max, len(c.tail))
	n, _ := c.f.WriteString(marker)
	m, _ := c.f.Write(c.tail)
	c.size = int64(n + m)
}

func (c *cappedConsole) remember(p []byte) {
	if len(p) >= c.keep {
		c.tail = append(c.tail[:0], p[len(p)-c.keep:]...)
		return
	}
	if over := len(c.tail) + len(p) - c.keep; over > 0 {
		c.tail = append(c.tail[:0], c.tail[over:]...)
	}
	c.tail = append(c.tail, p...)
}

// detach points fds (the agent's stdout and stderr) at /dev/null after a
// last line on the console, so that no descriptor in the sandbox refers
// to the console file any more (where /proc/<pid>/fd ignores
// dumpability, as in gVisor's sentry). What the agent logs afterwards, a
// Go panic included, is lost. Detaching twice is a no-op.
func (c *cappedConsole) detach(fds ...int) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.f == nil {
		return nil
	}
	null, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("detach console: %w", err)
	}
	defer null.Close()
	_, _ = c.f.WriteString("cube-agent: listening; console detached, nothing more is logged here\n")
	for _, fd := range fds {
		if err := unix.Dup3(int(null.Fd()), fd, 0); err != nil {
			return fmt.Errorf("detach console: dup3 onto fd %d: %w", fd, err)
		}
	}
	c.f, c.stopped, c.tail = nil, true, nil
	return nil
}
