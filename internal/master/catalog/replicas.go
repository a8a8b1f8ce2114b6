package catalog

import (
	"context"
	"database/sql"
	"time"
)

// What replicas of a shared catalog tell one another through it: route
// changes and sandbox traffic.

// RouteEvent is one route change.
type RouteEvent struct {
	ID        string
	SandboxID string
	AtMS      int64 // the database's clock
}

// AddRouteEvent records that a sandbox's route changed.
func (c *Catalog) AddRouteEvent(ctx context.Context, id, sandboxID string) error {
	_, err := c.exec(ctx, `INSERT INTO route_events (id, sandbox_id, at_ms) VALUES (?, ?, `+c.nowMS()+`)`, id, sandboxID)
	return err
}

// RouteEventsSince returns the route changes recorded at or after sinceMS,
// oldest first, and the database's clock now.
func (c *Catalog) RouteEventsSince(ctx context.Context, sinceMS int64) ([]RouteEvent, int64, error) {
	var now int64
	if err := c.db.QueryRowContext(ctx, `SELECT `+c.nowMS()).Scan(&now); err != nil {
		return nil, 0, err
	}
	rows, err := c.db.QueryContext(ctx, `SELECT id, sandbox_id, at_ms FROM route_events WHERE at_ms >= ? ORDER BY at_ms`, sinceMS)
	if err != nil {
		return nil, 0, err
	}
	defer rows.Close()
	var out []RouteEvent
	for rows.Next() {
		var e RouteEvent
		if err := rows.Scan(&e.ID, &e.SandboxID, &e.AtMS); err != nil {
			return nil, 0, err
		}
		out = append(out, e)
	}
	return out, now, rows.Err()
}

// PruneRouteEvents forgets route changes older than age (database clock).
func (c *Catalog) PruneRouteEvents(ctx context.Context, age time.Duration) error {
	_, err := c.exec(ctx, `DELETE FROM route_events WHERE at_ms < `+c.nowMS()+` - ?`, age.Milliseconds())
	return err
}

// Activity is one replica's view of one sandbox's traffic.
type Activity struct {
	SandboxID string
	Replica   string
	Last      time.Time // last traffic; zero: none seen
	Open      int64     // requests and streams open now
	At        time.Time // when the replica wrote it
	// QuiesceToken answers a quiesce by another replica: the token of
	// the move's lease, once every proxy watching this replica has
	// dropped the sandbox's route and counted what it has open (0: none).
	QuiesceToken int64
}

// PutActivity writes a replica's view of sandboxes' traffic.
func (c *Catalog) PutActivity(ctx context.Context, acts []Activity) error {
	if len(acts) == 0 {
		return nil
	}
	return c.tx(ctx, func(tx *sql.Tx) error {
		for _, a := range acts {
			res, err := tx.ExecContext(ctx, `UPDATE sandbox_activity SET last_ms = ?, open_n = ?, at_ms = ?, quiesce_token = ? WHERE sandbox_id = ? AND replica = ?`,
				ms(a.Last), a.Open, ms(a.At), a.QuiesceToken, a.SandboxID, a.Replica)
			if err != nil {
				return err
			}
			if n, err := res.RowsAffected(); err != nil {
				return err
			} else if n > 0 {
				continue
			}
			if _, err := tx.ExecContext(ctx, `INSERT INTO sandbox_activity (sandbox_id, replica, last_ms, open_n, at_ms, quiesce_token) VALUES (?, ?, ?, ?, ?, ?)`,
				a.SandboxID, a.Replica, ms(a.Last), a.Open, ms(a.At), a.QuiesceToken); err != nil && !isDuplicate(err) {
				return err
			}
		}
		return nil
	})
}

// ListActivity returns every replica's view of every sandbox's traffic.
func (c *Catalog) ListActivity(ctx context.Context) ([]Activity, error) {
	return c.listActivity(ctx, `SELECT sandbox_id, replica, last_ms, open_n, at_ms, quiesce_token FROM sandbox_activity`)
}

// ActivityOf returns every replica's view of one sandbox's traffic.
func (c *Catalog) ActivityOf(ctx context.Context, sandboxID string) ([]Activity, error) {
	return c.listActivity(ctx, `SELECT sandbox_id, replica, last_ms, open_n, at_ms, quiesce_token FROM sandbox_activity WHERE sandbox_id = ?`, sandboxID)
}

func (c *Catalog) listActivity(ctx context.Context, query string, args ...any) ([]Activity, error) {
	rows, err := c.db.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []Activity
	for rows.Next() {
		var a Activity
		var last, at int64
		if err := rows.Scan(&a.SandboxID, &a.Replica, &last, &a.Open, &at, &a.QuiesceToken); err != nil {
			return nil, err
		}
		a.Last, a.At = fromMS(last), fromMS(at)
		out = append(out, a)
	}
	return out, rows.Err()
}

// PruneActivity drops the traffic rows of sandboxes the catalog no longer
// has, and rows not written since before.
func (c *Catalog) PruneActivity(ctx context.Context, before time.Time) error {
	_, err := c.exec(ctx, `DELETE FROM sandbox_activity WHERE at_ms < ? OR sandbox_id NOT IN (SELECT id FROM sandboxes)`, ms(before))
	return err
}
