package agentchan

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"
)

// The serial port carries no session boundaries: bytes of an old host
// connection (or of the old guest session, e.g. a GOAWAY) can still be in
// flight when a new host connects, and a quick reconnect may never show
// the guest an EOF. Each session therefore starts with a handshake:
//
//	host:  "\xff\xff\xffCUBE-SYNC <nonce>\n"  (repeated until acknowledged)
//	guest: "\nCUBE-ACK <nonce>\n"
//	host:  HTTP/2 connection preface, then HTTP/2
//
// The guest skips everything before a SYNC line and, after acknowledging,
// everything before the HTTP/2 preface (repeated SYNCs); the host skips
// everything before its nonce's ACK. Neither marker can occur inside an
// HTTP/2 preface, so stale bytes are never taken for a session start.
const (
	// The SYNC marker opens with a frame length no HTTP/2 peer accepts,
	// so even a session that misses it (portConn looks only at the start
	// of each chunk) fails fast rather than reading it as a payload.
	syncPrefix = "\xff\xff\xffCUBE-SYNC "
	ackPrefix  = "\nCUBE-ACK "
	h2Preface  = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
	// syncTimeout bounds the host's wait for an acknowledgement.
	syncTimeout = 10 * time.Second
	maxScan     = 1 << 20 // stale bytes tolerated before giving up
)

var errNoSync = errors.New("agentchan: no session handshake")

// scanner reads from r until a marker shows up, keeping what follows it.
type scanner struct {
	r   io.Reader
	buf []byte
}

// until returns the bytes after marker and up to the next '\n' (empty
// when untilNL is false), leaving the rest in s.buf.
func (s *scanner) until(marker string, untilNL bool) (string, error) {
	chunk := make([]byte, 4096)
	for {
		if i := bytes.Index(s.buf, []byte(marker)); i >= 0 {
			rest := s.buf[i+len(marker):]
			if !untilNL {
				s.buf = rest
				return "", nil
			}
			if j := bytes.IndexByte(rest, '\n'); j >= 0 {
				s.buf = rest[j+1:]
				return string(rest[:j]), nil
			}
		}
		if len(s.buf) > maxScan {
			// Keep a tail that may hold the start of the marker.
			s.buf = append([]byte(nil), s.buf[len(s.buf)-len(marker)-64:]...)
		}
		n, err := s.r.Read(chunk)
		s.buf = append(s.buf, chunk[:n]...)
		if err != nil {
			return "", err
		}
	}
}

// guestSync runs the guest's side of the handshake on a port where a host
// is connected, and returns a conn whose reads start with the preface.
func guestSync(c net.Conn) (net.Conn, error) {
	s := &scanner{r: c}
	nonce, err := s.until(syncPrefix, true)
	if err != nil {
		return nil, err
	}
	for {
		if _, err := io.WriteString(c, ackPrefix+nonce+"\n"); err != nil {
			return nil, err
		}
		// Wait for the preface. A SYNC with another nonce first means the
		// host that was acknowledged is gone and a new one is waiting
		// (or a session reset on bytes that only looked like a SYNC):
		// acknowledge the new one. The same nonce again is that host
		// resending before it saw the ACK: ignore it, since a second ACK
		// would land inside its HTTP/2 stream.
		for {
			next, isSync, err := s.prefaceOrSync()
			if err != nil {
				return nil, err
			}
			if !isSync {
				return &sessionConn{Conn: &prefixConn{Conn: c, prefix: append([]byte(h2Preface), s.buf...)}}, nil
			}
			if next != nonce {
				nonce = next
				break
			}
		}
	}
}

// prefaceOrSync reads until the HTTP/2 preface or a complete SYNC line,
// whichever comes first. For a SYNC it returns its nonce and leaves what
// follows the line in s.buf; for the preface it leaves what follows it.
func (s *scanner) prefaceOrSync() (nonce string, isSync bool, err error) {
	chunk := make([]byte, 4096)
	for {
		p := bytes.Index(s.buf, []byte(h2Preface))
		y := bytes.Index(s.buf, []byte(syncPrefix))
		if y >= 0 && (p < 0 || y < p) {
			rest := s.buf[y+len(syncPrefix):]
			if j := bytes.IndexByte(rest, '\n'); j >= 0 {
				s.buf = rest[j+1:]
				return string(rest[:j]), true, nil
			}
		} else if p >= 0 {
			s.buf = s.buf[p+len(h2Preface):]
			return "", false, nil
		}
		if len(s.buf) > maxScan {
			s.buf = append([]byte(nil), s.buf[len(s.buf)-len(h2Preface)-64:]...)
		}
		n, err := s.r.Read(chunk)
		s.buf = append(s.buf, chunk[:n]...)
		if err != nil {
			return "", false, err
		}
	}
}

// hostSync runs the host's side on a freshly dialed conn. The SYNC line
// is resent with a doubling interval, since a guest session that had not
// yet noticed the old host leave may swallow the first one.
func hostSync(ctx context.Context, c net.Conn) (net.Conn, error) {
	var nb [8]byte
	rand.Read(nb[:])
	nonce := hex.EncodeToString(nb[:])
	// The error names the bound that ended the wait: this one, or the
	// caller's deadline when that comes first.
	limit := syncTimeout
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) < limit {
		limit = max(time.Until(dl), 0).Round(time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(ctx, syncTimeout)
	defer cancel()
	stop := context.AfterFunc(ctx, func() { _ = c.SetReadDeadline(time.Now()) }) // best effort: unblocks the reader
	defer stop()

	type result struct {
		buf []byte
		err error
	}
	done := make(chan result, 1)
	go func() {
		s := &scanner{r: c}
		for {
			got, err := s.until(ackPrefix, true)
			if err != nil || got == nonce {
				done <- result{s.buf, err}
				return
			}
		}
	}()
	interval := 20 * time.Millisecond
	for {
		if _, err := io.WriteString(c, syncPrefix+nonce+"\n"); err != nil {
			return nil, fmt.Errorf("agentchan: handshake: %w", err)
		}
		select {
		case r := <-done:
			if r.err != nil {
				if ctx.Err() != nil {
					return nil, fmt.Errorf("%w within %v: %w", errNoSync, limit, ctx.Err())
				}
				return nil, fmt.Errorf("agentchan: handshake: %w", r.err)
			}
			if !stop() {
				return nil, fmt.Errorf("%w: %w", errNoSync, ctx.Err())
			}
			if err := c.SetReadDeadline(time.Time{}); err != nil {
				return nil, fmt.Errorf("agentchan: handshake: %w", err)
			}
			return &prefixConn{Conn: c, prefix: r.buf}, nil
		case <-time.After(interval):
			interval = min(interval*2, time.Second)
		}
	}
}

// sessionConn is one guest session's end of the port. Once the session is
// closed it reads, writes and sets deadlines no more, and Close returns
// only when no read or write of it is still in the port: the port's
// deadline, which Close sets to cut them, is cleared for the next
// session, and the old session's HTTP/2 server may still have a frame
// queued (a PING's answer, which would land in the new host's stream
// right after its ACK) or a reader about to read (which would take the
// new session's bytes).
type sessionConn struct {
	net.Conn
	mu     sync.Mutex
	closed bool
	ops    sync.WaitGroup
}

// begin counts an operation in, unless the session is closed.
func (s *sessionConn) begin() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.ops.Add(1)
	return true
}

func (s *sessionConn) Read(b []byte) (int, error) {
	if !s.begin() {
		return 0, net.ErrClosed
	}
	defer s.ops.Done()
	return s.Conn.Read(b)
}

func (s *sessionConn) Write(b []byte) (int, error) {
	if !s.begin() {
		return 0, net.ErrClosed
	}
	defer s.ops.Done()
	return s.Conn.Write(b)
}

func (s *sessionConn) SetDeadline(t time.Time) error {
	return s.guard(func() error { return s.Conn.SetDeadline(t) })
}

func (s *sessionConn) SetReadDeadline(t time.Time) error {
	return s.guard(func() error { return s.Conn.SetReadDeadline(t) })
}

func (s *sessionConn) SetWriteDeadline(t time.Time) error {
	return s.guard(func() error { return s.Conn.SetWriteDeadline(t) })
}

// guard runs f as an operation of the session, unless it is closed.
func (s *sessionConn) guard(f func() error) error {
	if !s.begin() {
		return net.ErrClosed
	}
	defer s.ops.Done()
	return f()
}

// Close ends the session: no new operation starts, the port's deadline
// cuts those in the port, and Close waits until they have returned.
func (s *sessionConn) Close() error {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	err := s.Conn.Close()
	s.ops.Wait()
	return err
}

// prefixConn replays bytes already read off the wire before reading on.
type prefixConn struct {
	net.Conn
	prefix []byte
}

func (p *prefixConn) Read(b []byte) (int, error) {
	if len(p.prefix) > 0 {
		n := copy(b, p.prefix)
		p.prefix = p.prefix[n:]
		return n, nil
	}
	return p.Conn.Read(b)
}
