package catalog

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// Snapshot is a sandbox snapshot, held by the node it was taken on.
type Snapshot struct {
	ID         string
	Name       string // optional, unique when set
	SandboxID  string
	NodeID     string
	TemplateID string
	HasMemory  bool
	// EnvdAccessToken is the token the snapshotted agent holds: a sandbox
	// restored from the memory image needs it to be given a new one.
	EnvdAccessToken string
	CreatedAt       time.Time
	// Runtime is the driver of the snapshotted sandbox; its clones run on
	// the same one.
	Runtime string
	// Team owns the snapshot (its sandbox's team; "" at create is
	// DefaultTeam). Names are per team: each team resolves only its own.
	Team string
}

const snapshotCols = `id, name, sandbox_id, node_id, template_id, has_memory, envd_access_token, created_at, runtime, team`

func scanSnapshot(s interface{ Scan(...any) error }) (*Snapshot, error) {
	var sn Snapshot
	var mem int
	var created int64
	if err := s.Scan(&sn.ID, &sn.Name, &sn.SandboxID, &sn.NodeID, &sn.TemplateID, &mem, &sn.EnvdAccessToken, &created, &sn.Runtime, &sn.Team); err != nil {
		return nil, err
	}
	sn.HasMemory, sn.CreatedAt = mem != 0, fromMS(created)
	return &sn, nil
}

// CreateSnapshot records a snapshot. AlreadyExists if the ID is taken.
func (c *Catalog) CreateSnapshot(ctx context.Context, s *Snapshot) error {
	if s.Team == "" {
		s.Team = DefaultTeam
	}
	_, err := c.exec(ctx, `INSERT INTO snapshots (`+snapshotCols+`) VALUES (`+placeholders(10)+`)`,
		s.ID, s.Name, s.SandboxID, s.NodeID, s.TemplateID, b2i(s.HasMemory), s.EnvdAccessToken, ms(s.CreatedAt), s.Runtime, s.Team)
	if isDuplicate(err) {
		return fmt.Errorf("snapshot %q: %w", s.ID, errdefs.ErrAlreadyExists)
	}
	return err
}

// GetSnapshot finds a snapshot by ID or, failing that, by name (the newest
// of that name), in any team.
func (c *Catalog) GetSnapshot(ctx context.Context, idOrName string) (*Snapshot, error) {
	return c.GetTeamSnapshot(ctx, "", idOrName)
}

// GetTeamSnapshot is GetSnapshot within one team ("": any): another team's
// snapshot, by ID or by name, is NotFound, and a name resolves to the
// team's own snapshot of that name even when other teams use it too.
func (c *Catalog) GetTeamSnapshot(ctx context.Context, team, idOrName string) (*Snapshot, error) {
	cond, args := ``, []any{idOrName}
	if team != "" {
		cond, args = ` AND team = ?`, append(args, team)
	}
	s, err := scanSnapshot(c.db.QueryRowContext(ctx, `SELECT `+snapshotCols+` FROM snapshots WHERE id = ?`+cond, args...))
	if errors.Is(err, sql.ErrNoRows) {
		s, err = scanSnapshot(c.db.QueryRowContext(ctx,
			`SELECT `+snapshotCols+` FROM snapshots WHERE name = ?`+cond+` ORDER BY created_at DESC LIMIT 1`, args...))
	}
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("snapshot %q: %w", idOrName, errdefs.ErrNotFound)
	}
	return s, err
}

// SnapshotQuery selects snapshots; zero fields do not filter.
type SnapshotQuery struct {
	Team      string
	SandboxID string
	Name      string // matches the name or the ID
	Limit     int
	After     string // ID of the last row of the previous page
}

// ListSnapshots returns a page of snapshots by ID and the next page's token.
func (c *Catalog) ListSnapshots(ctx context.Context, q SnapshotQuery) ([]*Snapshot, string, error) {
	stmt := `SELECT ` + snapshotCols + ` FROM snapshots WHERE id > ?`
	args := []any{q.After}
	if q.Team != "" {
		stmt += ` AND team = ?`
		args = append(args, q.Team)
	}
	if q.SandboxID != "" {
		stmt += ` AND sandbox_id = ?`
		args = append(args, q.SandboxID)
	}
	if q.Name != "" {
		stmt += ` AND (name = ? OR id = ?)`
		args = append(args, q.Name, q.Name)
	}
	stmt += ` ORDER BY id`
	if q.Limit > 0 {
		stmt += ` LIMIT ` + strconv.Itoa(q.Limit+1) //nolint:gosec // G202: an int, formatted here
	}
	rows, err := c.db.QueryContext(ctx, stmt, args...)
	if err != nil {
		return nil, "", err
	}
	defer rows.Close()
	var out []*Snapshot
	for rows.Next() {
		s, err := scanSnapshot(rows)
		if err != nil {
			return nil, "", err
		}
		out = append(out, s)
	}
	if err := rows.Err(); err != nil {
		return nil, "", err
	}
	next := ""
	if q.Limit > 0 && len(out) > q.Limit {
		out = out[:q.Limit]
		next = out[len(out)-1].ID
	}
	return out, next, nil
}

// DeleteSnapshot forgets a snapshot.
func (c *Catalog) DeleteSnapshot(ctx context.Context, id string) error {
	res, err := c.exec(ctx, `DELETE FROM snapshots WHERE id = ?`, id)
	if err != nil {
		return err
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("snapshot %q: %w", id, errdefs.ErrNotFound)
	}
	return nil
}
