package agent

import (
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/cubesandbox/cube/internal/agent/logring"
	"github.com/cubesandbox/cube/internal/agent/rpcerr"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/errdefs"
)

// maxLogsPage bounds one answer of GET /_cube/logs, in entries and in
// bytes (the host reads at most 1 MiB of an answer).
const (
	maxLogsPage  = 1000
	maxLogsBytes = 512 << 10
)

// handleLogs serves the sandbox's log (agentproto.PathLogs).
func (a *Server) handleLogs(w http.ResponseWriter, r *http.Request) {
	qv := r.URL.Query()
	q := logring.Query{Limit: maxLogsPage, MaxBytes: maxLogsBytes, Backward: qv.Get("direction") == "backward"}
	for _, f := range []struct {
		name string
		to   *time.Time
	}{{"start", &q.Start}, {"end", &q.End}} {
		if v := qv.Get(f.name); v != "" {
			ms, err := strconv.ParseInt(v, 10, 64)
			if err != nil || ms < 0 {
				rpcerr.WriteHTTP(w, fmt.Errorf("%s %q: want Unix milliseconds: %w", f.name, v, errdefs.ErrInvalidArgument))
				return
			}
			*f.to = time.UnixMilli(ms)
			if f.name == "end" { // the whole of that millisecond
				*f.to = time.UnixMilli(ms + 1).Add(-time.Nanosecond)
			}
		}
	}
	if v := qv.Get("after"); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			rpcerr.WriteHTTP(w, fmt.Errorf("after %q: want a sequence number: %w", v, errdefs.ErrInvalidArgument))
			return
		}
		q.After = n
	}
	if v := qv.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > maxLogsPage {
			rpcerr.WriteHTTP(w, fmt.Errorf("limit %q: want 1-%d: %w", v, maxLogsPage, errdefs.ErrInvalidArgument))
			return
		}
		q.Limit = n
	}
	entries, dropped := a.cfg.Logs.Read(q)
	writeJSON(w, http.StatusOK, agentproto.LogsResponse{Entries: entries, Dropped: dropped})
}
