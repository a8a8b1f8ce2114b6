package catalog

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// Secret is one named secret of a team. Sealed is its value as the master
// encrypted it (the catalog never sees the clear value); KeyID names the
// key that sealed it.
type Secret struct {
	Team      string
	Name      string
	KeyID     string
	Sealed    string
	CreatedAt time.Time
	UpdatedAt time.Time
}

const secretCols = `team, name, key_id, sealed, created_ms, updated_ms`

func scanSecret(r interface{ Scan(...any) error }) (*Secret, error) {
	var s Secret
	var created, updated int64
	if err := r.Scan(&s.Team, &s.Name, &s.KeyID, &s.Sealed, &created, &updated); err != nil {
		return nil, err
	}
	s.CreatedAt, s.UpdatedAt = fromMS(created), fromMS(updated)
	return &s, nil
}

// CreateSecret adds a secret; ErrAlreadyExists when the team has one of
// that name.
func (c *Catalog) CreateSecret(ctx context.Context, s *Secret) error {
	_, err := c.exec(ctx, `INSERT INTO secrets (`+secretCols+`) VALUES (`+placeholders(6)+`)`,
		s.Team, s.Name, s.KeyID, s.Sealed, ms(s.CreatedAt), ms(s.UpdatedAt))
	if isDuplicate(err) {
		return fmt.Errorf("secret %q: %w", s.Name, errdefs.ErrAlreadyExists)
	}
	return err
}

// ReplaceSecret replaces the value of an existing secret.
func (c *Catalog) ReplaceSecret(ctx context.Context, s *Secret) error {
	res, err := c.exec(ctx, `UPDATE secrets SET key_id = ?, sealed = ?, updated_ms = ? WHERE team = ? AND name = ?`,
		s.KeyID, s.Sealed, ms(s.UpdatedAt), s.Team, s.Name)
	if err != nil {
		return err
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("secret %q: %w", s.Name, errdefs.ErrNotFound)
	}
	return nil
}

// GetSecret returns one secret of a team.
func (c *Catalog) GetSecret(ctx context.Context, team, name string) (*Secret, error) {
	s, err := scanSecret(c.db.QueryRowContext(ctx, `SELECT `+secretCols+` FROM secrets WHERE team = ? AND name = ?`, team, name))
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("secret %q: %w", name, errdefs.ErrNotFound)
	}
	return s, err
}

// ListSecrets returns a team's secrets by name.
func (c *Catalog) ListSecrets(ctx context.Context, team string) ([]*Secret, error) {
	rows, err := c.db.QueryContext(ctx, `SELECT `+secretCols+` FROM secrets WHERE team = ? ORDER BY name`, team)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []*Secret
	for rows.Next() {
		s, err := scanSecret(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, rows.Err()
}

// DeleteSecret removes one secret of a team.
func (c *Catalog) DeleteSecret(ctx context.Context, team, name string) error {
	res, err := c.exec(ctx, `DELETE FROM secrets WHERE team = ? AND name = ?`, team, name)
	if err != nil {
		return err
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("secret %q: %w", name, errdefs.ErrNotFound)
	}
	return nil
}
