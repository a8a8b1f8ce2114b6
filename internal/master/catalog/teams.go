package catalog

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// DefaultTeam owns the keys and rows written before teams existed, and
// keys created without a team.
const DefaultTeam = "default"

// Team is a tenant: its API keys see only its sandboxes and snapshots.
type Team struct {
	Name      string
	CreatedAt time.Time
	Quota     Quota
}

// Quota bounds a team's sandboxes: every row counts (creating, running
// and paused: a paused sandbox keeps its memory image and its slot on the
// node). Zero fields do not limit.
type Quota struct {
	MaxSandboxes int64
	MaxMilliCPU  int64
	MaxMemoryMiB int64
}

func (q Quota) limited() bool { return q.MaxSandboxes > 0 || q.MaxMilliCPU > 0 || q.MaxMemoryMiB > 0 }

// QuotaError is a create refused because it would take its team over a
// quota. It is ResourceExhausted (the E2B API answers 429).
type QuotaError struct {
	Team     string
	Resource string // "sandboxes", "vCPU" (in milli-CPU) or "memory" (MiB)
	Limit    int64
	Used     int64
	Asked    int64
}

func (e *QuotaError) Error() string {
	return fmt.Sprintf("team %q quota exceeded: %s limit %d, in use %d, this create asks %d more", e.Team, e.Resource, e.Limit, e.Used, e.Asked)
}

// Unwrap makes the error ResourceExhausted.
func (e *QuotaError) Unwrap() error { return errdefs.ErrResourceExhausted }

const teamCols = `name, created_at, max_sandboxes, max_milli_cpu, max_memory_mib`

func scanTeam(s interface{ Scan(...any) error }) (*Team, error) {
	var t Team
	var created int64
	if err := s.Scan(&t.Name, &created, &t.Quota.MaxSandboxes, &t.Quota.MaxMilliCPU, &t.Quota.MaxMemoryMiB); err != nil {
		return nil, err
	}
	t.CreatedAt = fromMS(created)
	return &t, nil
}

// CreateTeam stores a team. AlreadyExists if the name is taken.
func (c *Catalog) CreateTeam(ctx context.Context, t *Team) error {
	_, err := c.exec(ctx, `INSERT INTO teams (`+teamCols+`, creates) VALUES (`+placeholders(6)+`)`,
		t.Name, ms(t.CreatedAt), t.Quota.MaxSandboxes, t.Quota.MaxMilliCPU, t.Quota.MaxMemoryMiB, 0)
	if isDuplicate(err) {
		return fmt.Errorf("team %q: %w", t.Name, errdefs.ErrAlreadyExists)
	}
	return err
}

// SetTeamQuota replaces a team's quota. Rows over the new quota stay; new
// creates are refused until the team is under it.
func (c *Catalog) SetTeamQuota(ctx context.Context, name string, q Quota) error {
	res, err := c.exec(ctx, `UPDATE teams SET max_sandboxes = ?, max_milli_cpu = ?, max_memory_mib = ? WHERE name = ?`,
		q.MaxSandboxes, q.MaxMilliCPU, q.MaxMemoryMiB, name)
	if err != nil {
		return err
	}
	if n, _ := res.RowsAffected(); n == 0 {
		// MySQL counts only changed rows: tell "same values" from "none".
		if _, err := c.GetTeam(ctx, name); err != nil {
			return err
		}
	}
	return nil
}

// GetTeam returns one team.
func (c *Catalog) GetTeam(ctx context.Context, name string) (*Team, error) {
	t, err := scanTeam(c.db.QueryRowContext(ctx, `SELECT `+teamCols+` FROM teams WHERE name = ?`, name))
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("team %q: %w", name, errdefs.ErrNotFound)
	}
	return t, err
}

// TeamUsage is what a team's rows hold now.
type TeamUsage struct {
	Sandboxes, MilliCPU, MemoryMiB int64
}

// ListTeams returns every team with its usage, by name.
func (c *Catalog) ListTeams(ctx context.Context) ([]*Team, map[string]TeamUsage, error) {
	rows, err := c.db.QueryContext(ctx, `SELECT `+teamCols+` FROM teams ORDER BY name`)
	if err != nil {
		return nil, nil, err
	}
	defer rows.Close()
	var out []*Team
	for rows.Next() {
		t, err := scanTeam(rows)
		if err != nil {
			return nil, nil, err
		}
		out = append(out, t)
	}
	if err := rows.Err(); err != nil {
		return nil, nil, err
	}
	urows, err := c.db.QueryContext(ctx, `SELECT team, COUNT(*), COALESCE(SUM(milli_cpu), 0), COALESCE(SUM(memory_mib), 0) FROM sandboxes GROUP BY team`)
	if err != nil {
		return nil, nil, err
	}
	defer urows.Close()
	usage := map[string]TeamUsage{}
	for urows.Next() {
		var team string
		var u TeamUsage
		if err := urows.Scan(&team, &u.Sandboxes, &u.MilliCPU, &u.MemoryMiB); err != nil {
			return nil, nil, err
		}
		usage[team] = u
	}
	return out, usage, urows.Err()
}

// teamLimited reports whether a team has a quota (read before the
// create's transaction: a team without one costs no write).
func (c *Catalog) teamLimited(ctx context.Context, team string) (bool, error) {
	t, err := c.GetTeam(ctx, team)
	if err != nil {
		return false, err
	}
	return t.Quota.limited(), nil
}

// checkQuota refuses, inside the transaction that inserts s, a row that
// would take its team over a quota. Its first statement writes the team's
// row: that takes the row's lock (InnoDB) or the database's write lock
// (SQLite) until the transaction ends, so the creates of one team are
// counted one after another and two concurrent creates cannot both fit
// under the last free slot. The write comes before any read on purpose:
// InnoDB's repeatable-read snapshot starts at a transaction's first read,
// so a read before the lock would count rows as they were before the
// creates it waited for.
func checkQuota(ctx context.Context, tx *sql.Tx, s *Sandbox) error {
	if _, err := tx.ExecContext(ctx, `UPDATE teams SET creates = creates + 1 WHERE name = ?`, s.Team); err != nil {
		return err
	}
	t, err := scanTeam(tx.QueryRowContext(ctx, `SELECT `+teamCols+` FROM teams WHERE name = ?`, s.Team))
	if errors.Is(err, sql.ErrNoRows) {
		return fmt.Errorf("team %q: %w", s.Team, errdefs.ErrNotFound)
	}
	if err != nil {
		return err
	}
	var u TeamUsage
	if err := tx.QueryRowContext(ctx, `SELECT COUNT(*), COALESCE(SUM(milli_cpu), 0), COALESCE(SUM(memory_mib), 0) FROM sandboxes WHERE team = ?`, s.Team).
		Scan(&u.Sandboxes, &u.MilliCPU, &u.MemoryMiB); err != nil {
		return err
	}
	q := t.Quota
	switch {
	case q.MaxSandboxes > 0 && u.Sandboxes+1 > q.MaxSandboxes:
		return &QuotaError{Team: s.Team, Resource: "sandboxes", Limit: q.MaxSandboxes, Used: u.Sandboxes, Asked: 1}
	case q.MaxMilliCPU > 0 && u.MilliCPU+s.MilliCPU > q.MaxMilliCPU:
		return &QuotaError{Team: s.Team, Resource: "milli-CPU", Limit: q.MaxMilliCPU, Used: u.MilliCPU, Asked: s.MilliCPU}
	case q.MaxMemoryMiB > 0 && u.MemoryMiB+s.MemoryMiB > q.MaxMemoryMiB:
		return &QuotaError{Team: s.Team, Resource: "memory MiB", Limit: q.MaxMemoryMiB, Used: u.MemoryMiB, Asked: s.MemoryMiB}
	}
	return nil
}

// TeamInUseError refuses to delete a team that still holds sandboxes or
// snapshots. It is FailedPrecondition.
type TeamInUseError struct {
	Team                 string
	Sandboxes, Snapshots int64
	// Volumes are never removed by a forced delete (their data would go
	// with them): the team's owner deletes them.
	Volumes int64
}

func (e *TeamInUseError) Error() string {
	if e.Volumes > 0 && e.Sandboxes == 0 && e.Snapshots == 0 {
		return fmt.Sprintf("team %q holds %d volumes: delete them first (DELETE /volumes/{volumeID} with a key of the team)", e.Team, e.Volumes)
	}
	return fmt.Sprintf("team %q holds %d sandboxes and %d snapshots: delete them first, or force the delete to kill them", e.Team, e.Sandboxes, e.Snapshots)
}

// Unwrap makes the error FailedPrecondition.
func (e *TeamInUseError) Unwrap() error { return errdefs.ErrFailedPrecondition }

// DeleteTeam removes a team and its API keys, which it returns, in one
// transaction that first makes sure no sandbox or snapshot row of the team
// is left (TeamInUseError otherwise, and nothing changes). NotFound when
// there is no such team.
func (c *Catalog) DeleteTeam(ctx context.Context, name string) ([]*APIKey, error) {
	var keys []*APIKey
	err := c.tx(ctx, func(tx *sql.Tx) error {
		// The team row's lock first (as checkQuota takes it): a create of
		// this team waits for this transaction, then finds no team.
		res, err := tx.ExecContext(ctx, `UPDATE teams SET creates = creates + 1 WHERE name = ?`, name)
		if err != nil {
			return err
		}
		if n, _ := res.RowsAffected(); n == 0 {
			return fmt.Errorf("team %q: %w", name, errdefs.ErrNotFound)
		}
		inUse := &TeamInUseError{Team: name}
		if err := tx.QueryRowContext(ctx, `SELECT COUNT(*) FROM sandboxes WHERE team = ?`, name).Scan(&inUse.Sandboxes); err != nil {
			return err
		}
		if err := tx.QueryRowContext(ctx, `SELECT COUNT(*) FROM snapshots WHERE team = ?`, name).Scan(&inUse.Snapshots); err != nil {
			return err
		}
		if err := tx.QueryRowContext(ctx, `SELECT COUNT(*) FROM volumes WHERE team = ?`, name).Scan(&inUse.Volumes); err != nil {
			return err
		}
		if inUse.Sandboxes > 0 || inUse.Snapshots > 0 || inUse.Volumes > 0 {
			return inUse
		}
		if keys, err = teamKeys(ctx, tx, name); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM api_keys WHERE team = ?`, name); err != nil {
			return err
		}
		// A team made later under the same name must not inherit these.
		if _, err := tx.ExecContext(ctx, `DELETE FROM secrets WHERE team = ?`, name); err != nil {
			return err
		}
		_, err = tx.ExecContext(ctx, `DELETE FROM teams WHERE name = ?`, name)
		return err
	})
	return keys, err
}

func teamKeys(ctx context.Context, tx *sql.Tx, team string) ([]*APIKey, error) {
	rows, err := tx.QueryContext(ctx, `SELECT `+apiKeyCols+` FROM api_keys WHERE team = ? ORDER BY created_at, id`, team)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []*APIKey
	for rows.Next() {
		k, err := scanAPIKey(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, k)
	}
	return out, rows.Err()
}
