// Package logring is a sandbox's log as the agent keeps it: lines in
// memory up to a byte cap, the oldest pushed out first, read by time
// range in either direction. The memory is the sandbox's own (the agent
// runs in its cgroup), so the cap bounds what a chatty sandbox costs
// itself, and the host keeps nothing.
package logring

import (
	"bytes"
	"sync"
	"time"

	"github.com/cubesandbox/cube/internal/agentproto"
)

// entryOverhead is what an entry costs beyond its text, for the cap.
const entryOverhead = 64

// MaxLine is the longest line kept: a longer one is cut into lines of
// this length.
const MaxLine = 8 << 10

// Ring keeps a sandbox's log lines.
type Ring struct {
	mu      sync.Mutex
	cap     int
	size    int
	entries []agentproto.LogEntry // oldest first
	seq     uint64
	dropped uint64
	now     func() time.Time
}

// New returns a ring that keeps at most capBytes of lines.
func New(capBytes int) *Ring { return &Ring{cap: capBytes, now: time.Now} }

func cost(e *agentproto.LogEntry) int { return len(e.Line) + len(e.Cmd) + entryOverhead }

// Add appends a line (without its newline).
func (r *Ring) Add(e agentproto.LogEntry) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seq++
	e.Seq = r.seq
	if e.Time.IsZero() {
		e.Time = r.now().UTC()
	}
	r.entries = append(r.entries, e)
	r.size += cost(&e)
	drop := 0
	for r.size > r.cap && drop < len(r.entries)-1 {
		r.size -= cost(&r.entries[drop])
		drop++
	}
	if drop > 0 {
		r.dropped += uint64(drop)
		// Copy down once the dead prefix is large, so the slice does not
		// grow without bound.
		r.entries = r.entries[drop:]
		if cap(r.entries) > 2*len(r.entries)+64 {
			r.entries = append([]agentproto.LogEntry(nil), r.entries...)
		}
	}
}

// Query selects entries.
type Query struct {
	Start, End time.Time // inclusive; zero = open
	// After selects entries after this sequence number: exact paging,
	// where a time cursor repeats or, past Limit lines in one instant,
	// cannot move on.
	After    uint64
	Limit    int
	Backward bool // newest first, from End back
	MaxBytes int  // stop once the entries' text passes this; 0 = no bound
}

// Read returns the entries q selects and the count of lines dropped so
// far.
func (r *Ring) Read(q Query) ([]agentproto.LogEntry, uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	in := func(e *agentproto.LogEntry) bool {
		return e.Seq > q.After && (q.Start.IsZero() || !e.Time.Before(q.Start)) && (q.End.IsZero() || !e.Time.After(q.End))
	}
	out := []agentproto.LogEntry{}
	bytes := 0
	take := func(e *agentproto.LogEntry) bool {
		if !in(e) {
			return true
		}
		if (q.Limit > 0 && len(out) >= q.Limit) || (q.MaxBytes > 0 && bytes > q.MaxBytes) {
			return false
		}
		out = append(out, *e)
		bytes += cost(e)
		return true
	}
	if q.Backward {
		for i := len(r.entries) - 1; i >= 0 && take(&r.entries[i]); i-- {
		}
	} else {
		for i := 0; i < len(r.entries) && take(&r.entries[i]); i++ {
		}
	}
	return out, r.dropped
}

// Writer splits what is written into lines and adds each, stamped like
// tmpl. A line without its newline yet waits for the rest, up to MaxLine;
// Flush adds it as it is.
type Writer struct {
	r    *Ring
	tmpl agentproto.LogEntry
	mu   sync.Mutex
	buf  []byte
}

// Writer returns a line writer into the ring.
func (r *Ring) Writer(tmpl agentproto.LogEntry) *Writer { return &Writer{r: r, tmpl: tmpl} }

// Write implements io.Writer; it never fails.
func (w *Writer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := len(p)
	for len(p) > 0 {
		i := bytes.IndexByte(p, '\n')
		if i < 0 {
			w.buf = append(w.buf, p...)
			for len(w.buf) >= MaxLine {
				w.emit(w.buf[:MaxLine])
				w.buf = append(w.buf[:0], w.buf[MaxLine:]...)
			}
			break
		}
		w.buf = append(w.buf, p[:i]...)
		for len(w.buf) > MaxLine {
			w.emit(w.buf[:MaxLine])
			w.buf = append(w.buf[:0], w.buf[MaxLine:]...)
		}
		w.emit(w.buf)
		w.buf = w.buf[:0]
		p = p[i+1:]
	}
	return n, nil
}

func (w *Writer) emit(line []byte) {
	e := w.tmpl
	e.Line = string(bytes.TrimSuffix(line, []byte("\r")))
	w.r.Add(e)
}

// Flush adds a pending partial line.
func (w *Writer) Flush() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.buf) > 0 {
		w.emit(w.buf)
		w.buf = w.buf[:0]
	}
}
