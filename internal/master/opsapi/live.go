package opsapi

import (
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// maxStreamsPerCaller bounds one caller's open live streams: each polls
// the catalog every LiveInterval, so they are not free (a few tabs need
// a handful).
const maxStreamsPerCaller = 16

// streams counts open live streams per caller.
type streams struct {
	mu sync.Mutex
	n  map[string]int
}

// openStream takes a stream for the caller of r, or answers 429 and false.
func (h *Handler) openStream(w http.ResponseWriter, r *http.Request) (func(), bool) {
	c := callerOf(r)
	who := c.user
	if c.key != nil {
		who = "key:" + c.key.ID
	}
	h.streams.mu.Lock()
	defer h.streams.mu.Unlock()
	if h.streams.n == nil {
		h.streams.n = map[string]int{}
	}
	if h.streams.n[who] >= maxStreamsPerCaller {
		writeJSON(w, http.StatusTooManyRequests, map[string]any{"code": http.StatusTooManyRequests,
			"message": fmt.Sprintf("%d live streams open already; close one (at most %d per caller)", h.streams.n[who], maxStreamsPerCaller)})
		return nil, false
	}
	h.streams.n[who]++
	return func() {
		h.streams.mu.Lock()
		defer h.streams.mu.Unlock()
		if h.streams.n[who]--; h.streams.n[who] <= 0 {
			delete(h.streams.n, who)
		}
	}, true
}

// live streams the sandbox list as server-sent events: an event "sandboxes"
// with the whole list at once and whenever it changes (state, node, new
// or gone), looked at every LiveInterval, plus a comment every 15 s to
// keep proxies from closing the stream.
func (h *Handler) live(w http.ResponseWriter, r *http.Request) {
	fl, ok := w.(http.Flusher)
	if !ok {
		writeError(w, fmt.Errorf("streaming unsupported"))
		return
	}
	done, ok := h.openStream(w, r)
	if !ok {
		return
	}
	defer done()
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusOK)
	fl.Flush()
	t := time.NewTicker(h.cfg.LiveInterval)
	defer t.Stop()
	var last []byte
	lastSent := time.Now()
	for {
		list, err := h.list(r, "")
		if err == nil {
			b, _ := json.Marshal(list)
			if string(b) != string(last) {
				if _, err := fmt.Fprintf(w, "event: sandboxes\ndata: %s\n\n", b); err != nil {
					return
				}
				fl.Flush()
				last, lastSent = b, time.Now()
			}
		}
		if time.Since(lastSent) > 15*time.Second {
			if _, err := fmt.Fprint(w, ": keep-alive\n\n"); err != nil {
				return
			}
			fl.Flush()
			lastSent = time.Now()
		}
		select {
		case <-r.Context().Done():
			return
		case <-t.C:
		}
	}
}

// sandboxLive streams one sandbox as server-sent events, looked at every
// LiveInterval: "metrics" with its samples (the whole history first, then
// each new one as the node takes it), "sandbox" with the sandbox at once
// and whenever it changes (state, node, deadline), and "gone" when it no
// longer exists, which ends the stream. The caller's team scopes it as
// every other read: another team's sandbox answers 404 before the stream
// starts.
func (h *Handler) sandboxLive(w http.ResponseWriter, r *http.Request) {
	fl, ok := w.(http.Flusher)
	if !ok {
		writeError(w, fmt.Errorf("streaming unsupported"))
		return
	}
	id := r.PathValue("sandboxID")
	if _, err := h.b.Get(r.Context(), id); err != nil {
		writeError(w, err)
		return
	}
	done, ok := h.openStream(w, r)
	if !ok {
		return
	}
	defer done()
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusOK)
	fl.Flush()
	send := func(event string, v any) bool {
		b, _ := json.Marshal(v)
		if _, err := fmt.Fprintf(w, "event: %s\ndata: %s\n\n", event, b); err != nil {
			return false
		}
		fl.Flush()
		return true
	}
	t := time.NewTicker(h.cfg.LiveInterval)
	defer t.Stop()
	var last []byte
	var since time.Time // after the newest sample sent
	lastSent := time.Now()
	for {
		sb, err := h.b.Get(r.Context(), id)
		switch {
		case errdefs.IsNotFound(err):
			send("gone", map[string]string{"id": id})
			return
		case err == nil:
			b, _ := json.Marshal(sandboxOf(sb))
			if string(b) != string(last) {
				if !send("sandbox", json.RawMessage(b)) {
					return
				}
				last, lastSent = b, time.Now()
			}
		}
		if ms, err := h.b.Metrics(r.Context(), id, since, time.Time{}); err == nil {
			out := make([]metricJSON, 0, len(ms))
			for _, m := range ms {
				if !m.Timestamp.After(since) && !since.IsZero() {
					continue // start is inclusive
				}
				out = append(out, metricOf(m))
				since = m.Timestamp
			}
			if len(out) > 0 {
				if !send("metrics", out) {
					return
				}
				lastSent = time.Now()
			}
		}
		if time.Since(lastSent) > 15*time.Second {
			if _, err := fmt.Fprint(w, ": keep-alive\n\n"); err != nil {
				return
			}
			fl.Flush()
			lastSent = time.Now()
		}
		select {
		case <-r.Context().Done():
			return
		case <-t.C:
		}
	}
}
