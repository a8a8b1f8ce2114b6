package catalog

import (
	"context"
	"encoding/json"
	"strconv"
	"sync"
	"time"
)

// Event is one entry in a sandbox's lifecycle log (created, paused,
// timeout changed, killed...), served as the sandbox's logs.
type Event struct {
	SandboxID string
	At        time.Time
	Level     string // debug, info, warn, error
	Message   string
	Fields    map[string]string
}

// eventClock hands out strictly increasing timestamps, so two events of
// one sandbox in the same millisecond still get distinct keys.
var eventClock struct {
	sync.Mutex
	last int64
}

func nextEventTime(t time.Time) int64 {
	eventClock.Lock()
	defer eventClock.Unlock()
	v := t.UnixMicro()
	if v <= eventClock.last {
		v = eventClock.last + 1
	}
	eventClock.last = v
	return v
}

// AddEvent appends an event to a sandbox's log. At is stored with
// microsecond resolution.
func (c *Catalog) AddEvent(ctx context.Context, e Event) error {
	if e.At.IsZero() {
		e.At = time.Now()
	}
	if e.Level == "" {
		e.Level = "info"
	}
	fields, _ := json.Marshal(e.Fields)
	_, err := c.exec(ctx, `INSERT INTO sandbox_events (sandbox_id, at, level, message, fields) VALUES (?, ?, ?, ?, ?)`,
		e.SandboxID, nextEventTime(e.At), e.Level, e.Message, string(fields))
	return err
}

// EventQuery selects a sandbox's events.
type EventQuery struct {
	SandboxID string
	Since     time.Time // inclusive; zero = from the start
	Backward  bool      // newest first
	Limit     int       // 0 = all
}

// ListEvents returns a sandbox's events in time order (or reversed).
func (c *Catalog) ListEvents(ctx context.Context, q EventQuery) ([]Event, error) {
	order, cmp := "ASC", ">="
	since := q.Since.UnixMicro()
	if q.Since.IsZero() {
		since = 0
	}
	if q.Backward {
		order, cmp = "DESC", "<="
		if q.Since.IsZero() {
			since = 1<<62 - 1
		}
	}
	stmt := `SELECT at, level, message, fields FROM sandbox_events WHERE sandbox_id = ? AND at ` + cmp + ` ? ORDER BY at ` + order
	if q.Limit > 0 {
		stmt += ` LIMIT ` + strconv.Itoa(q.Limit) //nolint:gosec // G202: an int, formatted here
	}
	rows, err := c.db.QueryContext(ctx, stmt, q.SandboxID, since)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []Event
	for rows.Next() {
		var e Event
		var at int64
		var fields string
		if err := rows.Scan(&at, &e.Level, &e.Message, &fields); err != nil {
			return nil, err
		}
		e.SandboxID, e.At = q.SandboxID, time.UnixMicro(at).UTC()
		_ = json.Unmarshal([]byte(fields), &e.Fields)
		out = append(out, e)
	}
	return out, rows.Err()
}
