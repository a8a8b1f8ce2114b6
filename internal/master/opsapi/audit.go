package opsapi

import (
	"net/http"
	"strconv"
	"sync"
	"time"
)

// auditKeep is how many entries the console's audit log holds.
const auditKeep = 2000

// auditEntry is one thing done through CubeOps: who, as which team, did
// what to what, and how it ended.
type auditEntry struct {
	Seq    uint64 `json:"seq"`
	T      int64  `json:"t"` // Unix ms
	By     string `json:"by"`
	Admin  bool   `json:"admin"`
	Team   string `json:"team,omitempty"` // the caller's team, else the target's when known
	Action string `json:"action"`
	Target string `json:"target,omitempty"`
	OK     bool   `json:"ok"`
	Error  string `json:"error,omitempty"`
	Remote string `json:"remote,omitempty"`
}

// auditLog is the console's audit trail: the last auditKeep entries in
// memory, each also written to the master's log (slog "audit"), which is
// where the durable copy lives. A ring: it never grows without bound.
type auditLog struct {
	mu   sync.Mutex
	ring []auditEntry
	next int
	seq  uint64
}

func newAuditLog(n int) *auditLog { return &auditLog{ring: make([]auditEntry, 0, n)} }

func (l *auditLog) add(e auditEntry) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.seq++
	e.Seq = l.seq
	if len(l.ring) < cap(l.ring) {
		l.ring = append(l.ring, e)
		l.next = len(l.ring) % cap(l.ring)
		return
	}
	l.ring[l.next] = e
	l.next = (l.next + 1) % len(l.ring)
}

// list returns up to limit entries older than before (a Seq; 0: from the
// newest), newest first, that keep admits.
func (l *auditLog) list(before uint64, limit int, keep func(auditEntry) bool) []auditEntry {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := []auditEntry{}
	n := len(l.ring)
	for i := 0; i < n && len(out) < limit; i++ {
		// Newest first: the slot before next, backwards.
		e := l.ring[(l.next-1-i+2*n)%n]
		if before != 0 && e.Seq >= before {
			continue
		}
		if keep(e) {
			out = append(out, e)
		}
	}
	return out
}

// record adds what the request's caller did; team is the target's team
// when the caller is the admin and it is known.
func (h *Handler) record(r *http.Request, action, target, team string, err error) {
	c := callerOf(r)
	e := auditEntry{T: time.Now().UnixMilli(), By: c.user, Admin: c.admin, Team: team, Action: action, Target: target,
		OK: err == nil, Remote: r.RemoteAddr}
	if c.key != nil {
		e.Team = c.key.Team
	}
	if err != nil {
		e.Error = err.Error()
	}
	h.trail.add(e)
	h.log.Info("audit", "by", e.By, "admin", e.Admin, "team", e.Team, "action", "console "+action, "target", target, "ok", e.OK, "err", e.Error)
}

// events pages the audit log newest first: before (a seq) and limit (100
// by default, at most 500). A team user sees its team's entries only.
func (h *Handler) events(w http.ResponseWriter, r *http.Request) {
	c := callerOf(r)
	limit := 100
	if v, err := strconv.Atoi(r.URL.Query().Get("limit")); err == nil && v > 0 {
		limit = min(v, 500)
	}
	before, _ := strconv.ParseUint(r.URL.Query().Get("before"), 10, 64)
	writeJSON(w, http.StatusOK, h.trail.list(before, limit, func(e auditEntry) bool {
		return c.admin || (c.key != nil && e.Team == c.key.Team)
	}))
}
