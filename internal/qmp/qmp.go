// Package qmp is a small client for QEMU's machine protocol (QMP) over a
// unix socket: greeting, capability negotiation, and commands matched to
// their replies by id. Asynchronous events are read and dropped: the vm
// driver polls state (query-status, query-migrate) instead of following
// events, so a reconnecting caller never misses one.
//
// QEMU serves one QMP client per socket at a time; callers open a client
// per operation and close it promptly.
package qmp

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"sync"
	"syscall"
	"time"
)

// Error is a QMP error reply.
type Error struct {
	Command string
	Class   string
	Desc    string
}

func (e *Error) Error() string {
	return fmt.Sprintf("qmp %s: %s: %s", e.Command, e.Class, e.Desc)
}

// Client is one QMP session. Methods are safe for concurrent use but run
// one command at a time.
type Client struct {
	mu   sync.Mutex
	conn net.Conn
	rd   *bufio.Reader
	next uint64
}

type message struct {
	QMP    json.RawMessage `json:"QMP"`
	Event  string          `json:"event"`
	ID     json.RawMessage `json:"id"`
	Return json.RawMessage `json:"return"`
	Error  *struct {
		Class string `json:"class"`
		Desc  string `json:"desc"`
	} `json:"error"`
}

// Dial connects to the QMP socket at path, reads the greeting and leaves
// negotiation mode, all within ctx.
func Dial(ctx context.Context, path string) (*Client, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("qmp dial %s: %w", path, err)
	}
	c := &Client{conn: conn, rd: bufio.NewReader(conn)}
	stop := c.bind(ctx)
	defer stop()
	greet, err := c.read()
	if err == nil && greet.QMP == nil {
		err = fmt.Errorf("unexpected greeting")
	}
	if err == nil {
		err = c.execLocked("qmp_capabilities", nil, nil, nil)
	}
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("qmp handshake %s: %w", path, ctxErr(ctx, err))
	}
	return c, nil
}

// bind makes blocking I/O on the connection honour ctx: its deadline
// directly, its cancellation by expiring the connection's deadline.
func (c *Client) bind(ctx context.Context) (stop func()) {
	dl, ok := ctx.Deadline()
	if !ok {
		dl = time.Time{}
	}
	_ = c.conn.SetDeadline(dl)
	undo := context.AfterFunc(ctx, func() { _ = c.conn.SetDeadline(time.Unix(1, 0)) })
	return func() { undo() }
}

// ctxErr prefers the context's error over the I/O timeout it caused, so
// callers can test errors.Is(err, context.Canceled).
func ctxErr(ctx context.Context, err error) error {
	if cerr := ctx.Err(); cerr != nil {
		return fmt.Errorf("%w (%v)", cerr, err)
	}
	return err
}

// Execute runs cmd with args (nil for none) and decodes the return value
// into out (nil to discard). A QMP error reply is returned as *Error.
func (c *Client) Execute(ctx context.Context, cmd string, args, out any) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	stop := c.bind(ctx)
	defer stop()
	return ctxErr(ctx, c.execLocked(cmd, args, out, nil))
}

// ExecuteFD is Execute with f passed along as SCM_RIGHTS ancillary data,
// for commands that take a file descriptor from the client ("getfd",
// "add-fd"): QEMU then needs no access to the file's path.
func (c *Client) ExecuteFD(ctx context.Context, cmd string, args, out any, f *os.File) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	stop := c.bind(ctx)
	defer stop()
	return ctxErr(ctx, c.execLocked(cmd, args, out, f))
}

func (c *Client) execLocked(cmd string, args, out any, f *os.File) error {
	c.next++
	id := strconv.FormatUint(c.next, 10)
	req := map[string]any{"execute": cmd, "id": id}
	if args != nil {
		req["arguments"] = args
	}
	b, err := json.Marshal(req)
	if err != nil {
		return fmt.Errorf("qmp %s: %w", cmd, err)
	}
	if err := c.write(append(b, '\n'), f); err != nil {
		return fmt.Errorf("qmp %s: write: %w", cmd, err)
	}
	for {
		m, err := c.read()
		if err != nil {
			return fmt.Errorf("qmp %s: %w", cmd, err)
		}
		if m.Event != "" || m.QMP != nil {
			continue
		}
		var got string
		if json.Unmarshal(m.ID, &got) != nil || got != id {
			continue // a reply to an earlier, abandoned command
		}
		if m.Error != nil {
			return &Error{Command: cmd, Class: m.Error.Class, Desc: m.Error.Desc}
		}
		if out != nil && m.Return != nil {
			if err := json.Unmarshal(m.Return, out); err != nil {
				return fmt.Errorf("qmp %s: decode reply: %w", cmd, err)
			}
		}
		return nil
	}
}

// write sends one request, with f's descriptor attached when f is set.
func (c *Client) write(b []byte, f *os.File) error {
	if f == nil {
		_, err := c.conn.Write(b)
		return err
	}
	uc, ok := c.conn.(*net.UnixConn)
	if !ok {
		return fmt.Errorf("passing a file needs a unix socket, have %T", c.conn)
	}
	rights := syscall.UnixRights(int(f.Fd()))
	n, oobn, err := uc.WriteMsgUnix(b, rights, nil)
	if err == nil && (n != len(b) || oobn != len(rights)) {
		err = io.ErrShortWrite
	}
	return err
}

func (c *Client) read() (message, error) {
	line, err := c.rd.ReadBytes('\n')
	if err != nil {
		return message{}, fmt.Errorf("read: %w", err)
	}
	var m message
	if err := json.Unmarshal(line, &m); err != nil {
		return message{}, fmt.Errorf("decode %q: %w", line, err)
	}
	return m, nil
}

// Close ends the session.
func (c *Client) Close() error { return c.conn.Close() }

// IsClosed reports whether err means QEMU closed the connection (it
// quit or crashed) instead of answering.
func IsClosed(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}
