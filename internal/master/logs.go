package master

import (
	"context"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"

	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// SandboxLog returns a sandbox's log as q selects it: what the control
// plane did to it (its events) merged in time order with what ran in it,
// from its agent while it runs — the agent's own lines and the output
// lines of the processes started through envd, which the agent keeps in
// memory up to a cap (agent.DefaultLogBytes; the oldest go first). A
// paused sandbox's agent is not asked (it does not run), so its log shows
// the events only until it resumes. Agent lines carry their source,
// stream, PID and command in Fields; stdout is level info, stderr warn,
// and the agent's own lines keep their level.
func (s *Service) SandboxLog(ctx context.Context, q catalog.EventQuery) ([]catalog.Event, error) {
	sb, err := s.Get(ctx, q.SandboxID)
	if err != nil {
		return nil, err
	}
	evs, err := s.cat.ListEvents(ctx, q)
	if err != nil {
		return nil, err
	}
	if sb.State != catalog.StateRunning {
		return evs, nil
	}
	t, err := s.Resolve(ctx, sb.ID)
	if err != nil {
		return evs, nil //nolint:nilerr // the events stand on their own when the agent cannot be reached
	}
	qv := url.Values{}
	if !q.Since.IsZero() {
		if q.Backward {
			qv.Set("end", strconv.FormatInt(q.Since.UnixMilli(), 10))
		} else {
			qv.Set("start", strconv.FormatInt(q.Since.UnixMilli(), 10))
		}
	}
	if q.Backward {
		qv.Set("direction", "backward")
	}
	if q.Limit > 0 && q.Limit < 1000 {
		qv.Set("limit", strconv.Itoa(q.Limit))
	}
	var resp agentproto.LogsResponse
	if _, err := s.agents.do(ctx, t, http.MethodGet, agentproto.PathLogs+"?"+qv.Encode(), sb.EnvdAccessToken, nil, &resp); err != nil {
		// An older agent (404) or one that does not answer: the events
		// stand on their own.
		s.log.Debug("sandbox log: agent", "sandbox_id", sb.ID, "err", err)
		return evs, nil
	}
	for _, e := range resp.Entries {
		evs = append(evs, logEvent(sb.ID, e))
	}
	sort.SliceStable(evs, func(i, j int) bool {
		if q.Backward {
			return evs[i].At.After(evs[j].At)
		}
		return evs[i].At.Before(evs[j].At)
	})
	if q.Limit > 0 && len(evs) > q.Limit {
		evs = evs[:q.Limit]
	}
	return evs, nil
}

// logEvent is one agent log line as a sandbox log entry.
func logEvent(id string, e agentproto.LogEntry) catalog.Event {
	level := "info"
	switch {
	case e.Source == agentproto.LogSourceAgent:
		level = slogLevel(e.Line)
		e.Line = slogMessage(e.Line)
	case e.Stream == "stderr":
		level = "warn"
	}
	f := map[string]string{"source": e.Source, "stream": e.Stream, "seq": strconv.FormatUint(e.Seq, 10)}
	if e.PID != 0 {
		f["pid"] = strconv.FormatUint(uint64(e.PID), 10)
	}
	if e.Cmd != "" {
		f["cmd"] = e.Cmd
	}
	return catalog.Event{SandboxID: id, At: e.Time, Level: level, Message: e.Line, Fields: f}
}

// slogLevel reads the level of a log/slog text line ("level=WARN").
func slogLevel(line string) string {
	_, rest, ok := strings.Cut(line, " level=")
	if !ok {
		return "info"
	}
	lv, _, _ := strings.Cut(rest, " ")
	switch strings.ToLower(lv) {
	case "debug":
		return "debug"
	case "warn":
		return "warn"
	case "error":
		return "error"
	}
	return "info"
}

// slogMessage drops a log/slog text line's time and level (the entry has
// both): `msg="process started" pid=13 ...`.
func slogMessage(line string) string {
	for _, k := range []string{"time=", "level="} {
		if strings.HasPrefix(line, k) {
			if _, rest, ok := strings.Cut(line, " "); ok {
				line = rest
			}
		}
	}
	return line
}
