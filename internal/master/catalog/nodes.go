package catalog

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// Node is a registered cubelet. Report is the node's last report as the
// master serialised it (opaque to the catalog).
type Node struct {
	ID            string
	Address       string
	Report        []byte
	Schedulable   bool
	RegisteredAt  time.Time
	LastHeartbeat time.Time
}

// NodeTemplate is a template present on a node.
type NodeTemplate struct {
	NodeID     string
	TemplateID string
	Digest     string
	SizeBytes  int64
	CreatedAt  time.Time
}

// PutNode records a node's report and replaces the set of templates it
// holds, in one transaction. A new node starts schedulable; an existing
// one keeps its schedulable flag and registration time unless registered
// is true (a cubelet restart), which resets the registration time.
func (c *Catalog) PutNode(ctx context.Context, n *Node, templates []NodeTemplate, registered bool) error {
	return c.tx(ctx, func(tx *sql.Tx) error {
		q := `UPDATE nodes SET address = ?, report = ?, last_heartbeat = ? WHERE id = ?`
		args := []any{n.Address, string(n.Report), ms(n.LastHeartbeat), n.ID}
		if registered {
			q = `UPDATE nodes SET address = ?, report = ?, last_heartbeat = ?, registered_at = ? WHERE id = ?`
			args = []any{n.Address, string(n.Report), ms(n.LastHeartbeat), ms(n.RegisteredAt), n.ID}
		}
		res, err := tx.ExecContext(ctx, q, args...)
		if err != nil {
			return err
		}
		if rows, _ := res.RowsAffected(); rows == 0 {
			if _, err := tx.ExecContext(ctx, `INSERT INTO nodes (id, address, report, schedulable, registered_at, last_heartbeat) VALUES (?, ?, ?, 1, ?, ?)`,
				n.ID, n.Address, string(n.Report), ms(n.RegisteredAt), ms(n.LastHeartbeat)); err != nil {
				return err
			}
		}
		if templates == nil {
			return nil
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM node_templates WHERE node_id = ?`, n.ID); err != nil {
			return err
		}
		for _, t := range templates {
			if _, err := tx.ExecContext(ctx, `INSERT INTO node_templates (node_id, template_id, digest, size_bytes, created_at) VALUES (?, ?, ?, ?, ?)`,
				n.ID, t.TemplateID, t.Digest, t.SizeBytes, ms(t.CreatedAt)); err != nil {
				return err
			}
		}
		return nil
	})
}

const nodeCols = `id, address, report, schedulable, registered_at, last_heartbeat`

func scanNode(s interface{ Scan(...any) error }) (*Node, error) {
	var n Node
	var report string
	var sched int
	var reg, hb int64
	if err := s.Scan(&n.ID, &n.Address, &report, &sched, &reg, &hb); err != nil {
		return nil, err
	}
	n.Report, n.Schedulable = []byte(report), sched != 0
	n.RegisteredAt, n.LastHeartbeat = fromMS(reg), fromMS(hb)
	return &n, nil
}

// GetNode returns one node.
func (c *Catalog) GetNode(ctx context.Context, id string) (*Node, error) {
	n, err := scanNode(c.db.QueryRowContext(ctx, `SELECT `+nodeCols+` FROM nodes WHERE id = ?`, id))
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("node %q: %w", id, errdefs.ErrNotFound)
	}
	return n, err
}

// ListNodes returns every node, by ID.
func (c *Catalog) ListNodes(ctx context.Context) ([]*Node, error) {
	rows, err := c.db.QueryContext(ctx, `SELECT `+nodeCols+` FROM nodes ORDER BY id`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []*Node
	for rows.Next() {
		n, err := scanNode(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, n)
	}
	return out, rows.Err()
}

// SetSchedulable cordons or uncordons a node.
func (c *Catalog) SetSchedulable(ctx context.Context, id string, on bool) error {
	res, err := c.exec(ctx, `UPDATE nodes SET schedulable = ? WHERE id = ?`, b2i(on), id)
	if err != nil {
		return err
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("node %q: %w", id, errdefs.ErrNotFound)
	}
	return nil
}

// DeleteNode forgets a node and its templates.
func (c *Catalog) DeleteNode(ctx context.Context, id string) error {
	return c.tx(ctx, func(tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, `DELETE FROM node_templates WHERE node_id = ?`, id); err != nil {
			return err
		}
		res, err := tx.ExecContext(ctx, `DELETE FROM nodes WHERE id = ?`, id)
		if err != nil {
			return err
		}
		if n, _ := res.RowsAffected(); n == 0 {
			return fmt.Errorf("node %q: %w", id, errdefs.ErrNotFound)
		}
		return nil
	})
}

// ListNodeTemplates returns every (node, template) pair, by template then node.
func (c *Catalog) ListNodeTemplates(ctx context.Context) ([]NodeTemplate, error) {
	rows, err := c.db.QueryContext(ctx, `SELECT node_id, template_id, digest, size_bytes, created_at FROM node_templates`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []NodeTemplate
	for rows.Next() {
		var t NodeTemplate
		var created int64
		if err := rows.Scan(&t.NodeID, &t.TemplateID, &t.Digest, &t.SizeBytes, &created); err != nil {
			return nil, err
		}
		t.CreatedAt = fromMS(created)
		out = append(out, t)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].TemplateID != out[j].TemplateID {
			return out[i].TemplateID < out[j].TemplateID
		}
		return out[i].NodeID < out[j].NodeID
	})
	return out, rows.Err()
}
