package opsapi

import (
	"encoding/json"
	"fmt"
	"net/http"
	"time"
)

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
