// Package audit is network-agent's per-sandbox record of egress
// decisions: every DNS query the forwarder answered or refused and every
// connection the egress proxy allowed, denied or cut, one JSON object per
// line in <dir>/<sandbox_id>.jsonl, and the same event as a log line
// ("egress audit"), which is how it reaches the node's log stream.
package audit

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/cubesandbox/cube/internal/sandboxid"
)

// Kinds of events.
const (
	KindDNS     = "dns"     // a query
	KindConnect = "connect" // a connection through the egress proxy, when it ends or is refused
	KindCut     = "cut"     // an open connection closed by a policy update
)

// Verdicts.
const (
	Allowed = "allowed"
	Denied  = "denied"
	Failed  = "failed"
)

// Event is one audit line.
type Event struct {
	Time      time.Time `json:"time"`
	SandboxID string    `json:"sandbox_id"`
	Kind      string    `json:"kind"`
	Verdict   string    `json:"verdict"`
	// Name is the DNS name asked for, or the name a connection claimed
	// (TLS SNI, HTTP Host); Addr the destination (ip:port) or, for DNS,
	// the answer's IPv4 addresses.
	Name  string   `json:"name,omitempty"`
	Addr  string   `json:"addr,omitempty"`
	Addrs []string `json:"addrs,omitempty"`
	// Rule is the policy entry that decided; Reason why a denial.
	Rule   string `json:"rule,omitempty"`
	Reason string `json:"reason,omitempty"`
	// Mode is how the proxy carried a connection: "sni", "http" or
	// "terminated" (TLS terminated for credential injection).
	Mode string `json:"mode,omitempty"`
	// Injected names the headers a credential rule added (never values).
	Injected []string `json:"injected,omitempty"`
	QType    string   `json:"qtype,omitempty"`
	RCode    string   `json:"rcode,omitempty"`
	// BytesOut is what the sandbox sent, BytesIn what it received.
	BytesOut   int64   `json:"bytes_out,omitempty"`
	BytesIn    int64   `json:"bytes_in,omitempty"`
	DurationMS float64 `json:"duration_ms,omitempty"`
}

// Log writes events. The zero of *Log (nil) discards them.
type Log struct {
	dir  string
	keep time.Duration
	log  *slog.Logger

	mu      sync.Mutex
	files   map[string]*os.File
	pruned  time.Time
	pruning bool
	notable notableState
}

// pruneEvery is how often Close looks for files past keep.
const pruneEvery = time.Hour

// New returns a log writing under dir ("" = log lines only). Files of
// released sandboxes are removed once unchanged for keep (0: never).
func New(dir string, keep time.Duration, log *slog.Logger) (*Log, error) {
	if log == nil {
		log = slog.Default()
	}
	l := &Log{dir: dir, keep: keep, log: log, files: map[string]*os.File{}}
	if dir != "" {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return nil, fmt.Errorf("audit: %w", err)
		}
		l.prune()
	}
	return l, nil
}

// prune removes the files not open and unchanged for keep.
func (l *Log) prune() {
	if l.keep <= 0 {
		return
	}
	ents, err := os.ReadDir(l.dir)
	if err != nil {
		l.log.Warn("audit: prune", "err", err)
		return
	}
	cut := time.Now().Add(-l.keep)
	n := 0
	for _, e := range ents {
		id, ok := strings.CutSuffix(e.Name(), ".jsonl")
		if !ok {
			continue
		}
		l.mu.Lock()
		open := l.files[id] != nil
		l.mu.Unlock()
		if fi, err := e.Info(); err == nil && !open && fi.ModTime().Before(cut) {
			if os.Remove(filepath.Join(l.dir, e.Name())) == nil {
				n++
			}
		}
	}
	l.mu.Lock()
	l.pruned, l.pruning = time.Now(), false
	l.mu.Unlock()
	if n > 0 {
		l.log.Info("audit: removed old files", "files", n, "older_than", l.keep)
	}
}

// Path is where a sandbox's events go ("" without a directory).
func (l *Log) Path(sandboxID string) string {
	if l == nil || l.dir == "" {
		return ""
	}
	return filepath.Join(l.dir, sandboxID+".jsonl")
}

// Write records e (Time set when zero). A failure to write the file is
// logged, never returned: the decision it records has already been made.
func (l *Log) Write(e Event) {
	if l == nil {
		return
	}
	if e.Time.IsZero() {
		e.Time = time.Now().UTC()
	}
	b, err := json.Marshal(e)
	if err != nil {
		return
	}
	l.log.Info("egress audit", "event", json.RawMessage(b))
	if sandboxid.Validate("sandbox", e.SandboxID) != nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.queueNotable(e)
	if l.dir == "" {
		return
	}
	f := l.files[e.SandboxID]
	if f == nil {
		if f, err = os.OpenFile(l.Path(e.SandboxID), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600); err != nil {
			l.log.Warn("audit: open", "sandbox_id", e.SandboxID, "err", err)
			return
		}
		l.files[e.SandboxID] = f
	}
	if _, err := f.Write(append(b, '\n')); err != nil {
		l.log.Warn("audit: write", "sandbox_id", e.SandboxID, "err", err)
	}
}

// Close closes a sandbox's file (it is released: the file stays for the
// node's log shipper, until keep after its last event); at most once an
// hour it also removes files past keep, in the background.
func (l *Log) Close(sandboxID string) {
	if l == nil {
		return
	}
	l.mu.Lock()
	f := l.files[sandboxID]
	delete(l.files, sandboxID)
	due := l.dir != "" && l.keep > 0 && !l.pruning && time.Since(l.pruned) > pruneEvery
	if due {
		l.pruning = true
	}
	l.mu.Unlock()
	if f != nil {
		f.Close()
	}
	if due {
		go l.prune()
	}
}

// CloseAll closes every file.
func (l *Log) CloseAll() {
	if l == nil {
		return
	}
	l.mu.Lock()
	fs := l.files
	l.files = map[string]*os.File{}
	l.mu.Unlock()
	for _, f := range fs {
		f.Close()
	}
}
