package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/agent/rpcerr"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/errdefs"
)

// clockTolerance is how far the sandbox clock may drift before a sync sets
// it: a container shares the host clock and is always within it, so its
// syncs are no-ops; a restored VM is off by the time it was paused.
const clockTolerance = 50 * time.Millisecond

func (a *Server) handleInfo(w http.ResponseWriter, _ *http.Request) {
	frozen, _ := a.freezer.Frozen()
	writeJSON(w, http.StatusOK, agentproto.Info{EnvdVersion: EnvdVersion, AgentVersion: a.cfg.Version, PID: os.Getpid(), Frozen: frozen})
}

func (a *Server) handleFreeze(w http.ResponseWriter, r *http.Request) {
	var req agentproto.FreezeRequest
	if err := decodeOptional(r, &req); err != nil {
		rpcerr.WriteHTTP(w, err)
		return
	}
	timeout := 30 * time.Second
	if req.TimeoutMs != 0 {
		timeout = time.Duration(req.TimeoutMs) * time.Millisecond
	}
	until, err := a.freezer.Freeze(timeout)
	if err != nil {
		rpcerr.WriteHTTP(w, err)
		return
	}
	a.log.Info("filesystem frozen", "path", a.freezer.Path, "until", until)
	writeJSON(w, http.StatusOK, map[string]any{"frozen": true, "thaw_deadline": until.UTC().Format(time.RFC3339Nano)})
}

func (a *Server) handleThaw(w http.ResponseWriter, _ *http.Request) {
	if err := a.freezer.Thaw(); err != nil {
		rpcerr.WriteHTTP(w, err)
		return
	}
	a.log.Info("filesystem thawed", "path", a.freezer.Path)
	writeJSON(w, http.StatusOK, map[string]any{"frozen": false})
}

func (a *Server) handleClock(w http.ResponseWriter, r *http.Request) {
	var req agentproto.ClockRequest
	if err := decodeOptional(r, &req); err != nil {
		rpcerr.WriteHTTP(w, err)
		return
	}
	if req.Timestamp.IsZero() {
		rpcerr.WriteHTTP(w, fmt.Errorf("clock: timestamp is required: %w", errdefs.ErrInvalidArgument))
		return
	}
	res, err := a.syncClock(req.Timestamp)
	if err != nil {
		rpcerr.WriteHTTP(w, err)
		return
	}
	writeJSON(w, http.StatusOK, res)
}

// syncClock sets CLOCK_REALTIME to ts when the sandbox is off by more than
// clockTolerance. Without CAP_SYS_TIME (every container) setting fails
// with FailedPrecondition; there the clock is the host's and never drifts.
func (a *Server) syncClock(ts time.Time) (agentproto.ClockResponse, error) {
	offset := time.Until(ts)
	res := agentproto.ClockResponse{OffsetMs: float64(offset) / float64(time.Millisecond)}
	if offset.Abs() <= clockTolerance {
		return res, nil
	}
	now := unix.NsecToTimespec(ts.UnixNano())
	if err := a.cfg.SetClock(now); err != nil {
		if errors.Is(err, unix.EPERM) {
			return res, fmt.Errorf("set clock (off by %s): %w: the sandbox lacks CAP_SYS_TIME; a container shares the host clock: %w",
				offset, err, errdefs.ErrFailedPrecondition)
		}
		return res, fmt.Errorf("set clock: %w", err)
	}
	a.log.Info("clock re-synced", "offset", offset)
	res.Adjusted = true
	return res, nil
}

// decodeOptional decodes a JSON body into v; an empty body is fine.
func decodeOptional(r *http.Request, v any) error {
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<16))
	if err != nil {
		return fmt.Errorf("read body: %w: %w", err, errdefs.ErrInvalidArgument)
	}
	if len(body) == 0 {
		return nil
	}
	if err := json.Unmarshal(body, v); err != nil {
		return fmt.Errorf("body is not valid JSON: %w: %w", err, errdefs.ErrInvalidArgument)
	}
	return nil
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}
