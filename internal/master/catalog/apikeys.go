package catalog

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// APIKey is a stored key: the SHA-256 of its secret, never the secret.
type APIKey struct {
	ID         string
	Name       string
	Prefix     string
	Hash       string // hex SHA-256 of the secret
	CreatedAt  time.Time
	LastUsedAt time.Time
	// Admin keys may do the E2B API's admin operations (template delete).
	Admin bool
	// Team the key belongs to: it sees that team's sandboxes and
	// snapshots only. "" at create is DefaultTeam.
	Team string
}

const apiKeyCols = `id, name, prefix, hash, created_at, last_used_at, admin, team`

func scanAPIKey(s interface{ Scan(...any) error }) (*APIKey, error) {
	var k APIKey
	var created, used, admin int64
	if err := s.Scan(&k.ID, &k.Name, &k.Prefix, &k.Hash, &created, &used, &admin, &k.Team); err != nil {
		return nil, err
	}
	k.CreatedAt, k.LastUsedAt, k.Admin = fromMS(created), fromMS(used), admin != 0
	return &k, nil
}

// CreateAPIKey stores a key. AlreadyExists if its name (or ID) is taken,
// NotFound if its team does not exist.
func (c *Catalog) CreateAPIKey(ctx context.Context, k *APIKey) error {
	if k.Team == "" {
		k.Team = DefaultTeam
	}
	if _, err := c.GetTeam(ctx, k.Team); err != nil {
		return err
	}
	_, err := c.exec(ctx, `INSERT INTO api_keys (`+apiKeyCols+`) VALUES (`+placeholders(8)+`)`,
		k.ID, k.Name, k.Prefix, k.Hash, ms(k.CreatedAt), ms(k.LastUsedAt), b2i(k.Admin), k.Team)
	if isDuplicate(err) {
		return fmt.Errorf("api key %q: %w", k.Name, errdefs.ErrAlreadyExists)
	}
	return err
}

// APIKeyByHash finds the key whose secret hashes to hash.
func (c *Catalog) APIKeyByHash(ctx context.Context, hash string) (*APIKey, error) {
	k, err := scanAPIKey(c.db.QueryRowContext(ctx, `SELECT `+apiKeyCols+` FROM api_keys WHERE hash = ?`, hash))
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("api key: %w", errdefs.ErrNotFound)
	}
	return k, err
}

// ListAPIKeys returns every key, oldest first.
func (c *Catalog) ListAPIKeys(ctx context.Context) ([]*APIKey, error) {
	rows, err := c.db.QueryContext(ctx, `SELECT `+apiKeyCols+` FROM api_keys ORDER BY created_at, id`)
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

// DeleteAPIKey removes the key with this ID or name and returns it.
func (c *Catalog) DeleteAPIKey(ctx context.Context, idOrName string) (*APIKey, error) {
	var k *APIKey
	err := c.tx(ctx, func(tx *sql.Tx) error {
		var err error
		k, err = scanAPIKey(tx.QueryRowContext(ctx, `SELECT `+apiKeyCols+` FROM api_keys WHERE id = ? OR name = ?`, idOrName, idOrName))
		if errors.Is(err, sql.ErrNoRows) {
			return fmt.Errorf("api key %q: %w", idOrName, errdefs.ErrNotFound)
		}
		if err != nil {
			return err
		}
		_, err = tx.ExecContext(ctx, `DELETE FROM api_keys WHERE id = ?`, k.ID)
		return err
	})
	return k, err
}

// TouchAPIKey records that a key was used at t.
func (c *Catalog) TouchAPIKey(ctx context.Context, id string, t time.Time) error {
	_, err := c.exec(ctx, `UPDATE api_keys SET last_used_at = ? WHERE id = ?`, ms(t), id)
	return err
}
