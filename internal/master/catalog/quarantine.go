package catalog

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"time"
)

// Quarantined is a row moved out of service because it did not decode.
type Quarantined struct {
	Table  string // where it was: "sandboxes"
	Key    string // its key there (the sandbox ID)
	Reason string // why it did not decode
	At     time.Time
	// Data is the row as JSON, column → value, with its metadata under
	// "metadata" for a sandbox.
	Data string
}

// Quarantine moves every sandbox row whose JSON column (network) does not
// decode, with its metadata, into the quarantine table, one transaction
// per row, and returns what it moved. Such a row would otherwise fail
// every query that reads it (a list, the expiry scan, a GET) for every
// sandbox; the master calls this at start and logs each. Nothing reads
// the quarantine table back into service.
func (c *Catalog) Quarantine(ctx context.Context) ([]Quarantined, error) {
	found, err := c.undecodable(ctx)
	if err != nil {
		return nil, err
	}
	var out []Quarantined
	for _, b := range found {
		q := Quarantined{Table: "sandboxes", Key: b.id, Reason: b.reason, At: time.Now().UTC().Truncate(time.Millisecond)}
		err := c.tx(ctx, func(tx *sql.Tx) error {
			row, err := rowJSON(ctx, tx, `SELECT * FROM sandboxes WHERE id = ?`, b.id)
			if err != nil {
				return err
			}
			md, err := rowsJSON(ctx, tx, `SELECT k, v FROM sandbox_metadata WHERE sandbox_id = ?`, b.id)
			if err != nil {
				return err
			}
			row["metadata"] = md
			data, err := json.Marshal(row)
			if err != nil {
				return err
			}
			q.Data = string(data)
			if _, err := tx.ExecContext(ctx, `INSERT INTO quarantine (tbl, row_key, reason, at, data) VALUES (?, ?, ?, ?, ?)`,
				q.Table, q.Key, q.Reason, ms(q.At), q.Data); err != nil {
				return err
			}
			if _, err := tx.ExecContext(ctx, `DELETE FROM sandbox_metadata WHERE sandbox_id = ?`, b.id); err != nil {
				return err
			}
			_, err = tx.ExecContext(ctx, `DELETE FROM sandboxes WHERE id = ?`, b.id)
			return err
		})
		if err != nil {
			return out, fmt.Errorf("catalog: quarantine sandbox %s: %w", b.id, err)
		}
		out = append(out, q)
	}
	return out, nil
}

// bad is a row that does not decode and why.
type bad struct{ id, reason string }

// undecodable finds the sandbox rows whose network column does not decode.
func (c *Catalog) undecodable(ctx context.Context) ([]bad, error) {
	rows, err := c.db.QueryContext(ctx, `SELECT id, network FROM sandboxes`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var found []bad
	for rows.Next() {
		var id, network string
		if err := rows.Scan(&id, &network); err != nil {
			return nil, err
		}
		if network == "" {
			continue
		}
		var n Network
		if err := json.Unmarshal([]byte(network), &n); err != nil {
			found = append(found, bad{id, "network column: " + err.Error()})
		}
	}
	return found, rows.Err()
}

// ListQuarantined returns the quarantined rows, oldest first.
func (c *Catalog) ListQuarantined(ctx context.Context) ([]Quarantined, error) {
	rows, err := c.db.QueryContext(ctx, `SELECT tbl, row_key, reason, at, data FROM quarantine ORDER BY at, tbl, row_key`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []Quarantined
	for rows.Next() {
		var q Quarantined
		var at int64
		if err := rows.Scan(&q.Table, &q.Key, &q.Reason, &at, &q.Data); err != nil {
			return nil, err
		}
		q.At = fromMS(at)
		out = append(out, q)
	}
	return out, rows.Err()
}

// rowJSON reads one row as column → value (bytes as text).
func rowJSON(ctx context.Context, tx *sql.Tx, query string, args ...any) (map[string]any, error) {
	all, err := rowsJSON(ctx, tx, query, args...)
	if err != nil {
		return nil, err
	}
	if len(all) != 1 {
		return nil, fmt.Errorf("%d rows, want 1", len(all))
	}
	return all[0], nil
}

func rowsJSON(ctx context.Context, tx *sql.Tx, query string, args ...any) ([]map[string]any, error) {
	rows, err := tx.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	cols, err := rows.Columns()
	if err != nil {
		return nil, err
	}
	var out []map[string]any
	for rows.Next() {
		vals := make([]any, len(cols))
		ptrs := make([]any, len(cols))
		for i := range vals {
			ptrs[i] = &vals[i]
		}
		if err := rows.Scan(ptrs...); err != nil {
			return nil, err
		}
		m := make(map[string]any, len(cols))
		for i, col := range cols {
			if b, ok := vals[i].([]byte); ok {
				vals[i] = string(b)
			}
			m[col] = vals[i]
		}
		out = append(out, m)
	}
	return out, rows.Err()
}
