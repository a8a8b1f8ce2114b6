package catalog

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// Volume is one volume of a team: an ext4 image on NodeID's storage pool
// ("" until a sandbox mounting it is first placed). SandboxID is the
// sandbox holding it ("" = none); a holder whose row is gone holds
// nothing (the master checks).
type Volume struct {
	ID        string
	Team      string
	Name      string
	SizeMiB   int64
	NodeID    string
	SandboxID string
	// MountPath is where SandboxID mounts it.
	MountPath string
	Token     string
	CreatedAt time.Time
}

const volumeCols = `id, team, name, size_mib, node_id, sandbox_id, mount_path, token, created_ms`

func scanVolume(r interface{ Scan(...any) error }) (*Volume, error) {
	var v Volume
	var created int64
	if err := r.Scan(&v.ID, &v.Team, &v.Name, &v.SizeMiB, &v.NodeID, &v.SandboxID, &v.MountPath, &v.Token, &created); err != nil {
		return nil, err
	}
	v.CreatedAt = fromMS(created)
	return &v, nil
}

// CreateVolume adds a volume; ErrAlreadyExists when its team has one of
// that name.
func (c *Catalog) CreateVolume(ctx context.Context, v *Volume) error {
	_, err := c.exec(ctx, `INSERT INTO volumes (`+volumeCols+`) VALUES (`+placeholders(9)+`)`,
		v.ID, v.Team, v.Name, v.SizeMiB, v.NodeID, v.SandboxID, v.MountPath, v.Token, ms(v.CreatedAt))
	if isDuplicate(err) {
		return fmt.Errorf("volume %q already exists: %w", v.Name, errdefs.ErrAlreadyExists)
	}
	return err
}

// GetVolume returns a team's volume by ID; another team's is NotFound.
func (c *Catalog) GetVolume(ctx context.Context, team, id string) (*Volume, error) {
	v, err := scanVolume(c.db.QueryRowContext(ctx, `SELECT `+volumeCols+` FROM volumes WHERE id = ? AND team = ?`, id, team))
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("volume %q not found: %w", id, errdefs.ErrNotFound)
	}
	return v, err
}

// GetVolumeByName returns a team's volume by name.
func (c *Catalog) GetVolumeByName(ctx context.Context, team, name string) (*Volume, error) {
	v, err := scanVolume(c.db.QueryRowContext(ctx, `SELECT `+volumeCols+` FROM volumes WHERE team = ? AND name = ?`, team, name))
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("volume %q not found: %w", name, errdefs.ErrNotFound)
	}
	return v, err
}

// ListVolumes returns a team's volumes by name.
func (c *Catalog) ListVolumes(ctx context.Context, team string) ([]*Volume, error) {
	rows, err := c.db.QueryContext(ctx, `SELECT `+volumeCols+` FROM volumes WHERE team = ? ORDER BY name`, team)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []*Volume
	for rows.Next() {
		v, err := scanVolume(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, rows.Err()
}

// ClaimVolume makes sandboxID the holder of volume id, mounted at path,
// if its holder is still from (compare and swap); false when another
// claim came first.
func (c *Catalog) ClaimVolume(ctx context.Context, id, from, sandboxID, path string) (bool, error) {
	res, err := c.exec(ctx, `UPDATE volumes SET sandbox_id = ?, mount_path = ? WHERE id = ? AND sandbox_id = ?`, sandboxID, path, id, from)
	if err != nil {
		return false, err
	}
	n, _ := res.RowsAffected()
	return n == 1, nil
}

// ReleaseVolumes clears sandboxID's hold on every volume.
func (c *Catalog) ReleaseVolumes(ctx context.Context, sandboxID string) error {
	_, err := c.exec(ctx, `UPDATE volumes SET sandbox_id = '', mount_path = '' WHERE sandbox_id = ?`, sandboxID)
	return err
}

// SandboxVolumes returns the volumes of team that sandboxID holds, by
// name.
func (c *Catalog) SandboxVolumes(ctx context.Context, team, sandboxID string) ([]*Volume, error) {
	rows, err := c.db.QueryContext(ctx, `SELECT `+volumeCols+` FROM volumes WHERE sandbox_id = ? AND team = ? ORDER BY name`, sandboxID, team)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []*Volume
	for rows.Next() {
		v, err := scanVolume(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, rows.Err()
}

// PlaceVolume records the node volume id lives on, if it had none; it
// returns the node it lives on now.
func (c *Catalog) PlaceVolume(ctx context.Context, id, nodeID string) (string, error) {
	if _, err := c.exec(ctx, `UPDATE volumes SET node_id = ? WHERE id = ? AND node_id = ''`, nodeID, id); err != nil {
		return "", err
	}
	var node string
	err := c.db.QueryRowContext(ctx, `SELECT node_id FROM volumes WHERE id = ?`, id).Scan(&node)
	if errors.Is(err, sql.ErrNoRows) {
		return "", fmt.Errorf("volume %q not found: %w", id, errdefs.ErrNotFound)
	}
	return node, err
}

// DeleteVolume removes a team's volume if nothing holds it (holder as
// read by the caller: a claim since makes it FailedPrecondition).
func (c *Catalog) DeleteVolume(ctx context.Context, team, id, holder string) error {
	res, err := c.exec(ctx, `DELETE FROM volumes WHERE id = ? AND team = ? AND sandbox_id = ?`, id, team, holder)
	if err != nil {
		return err
	}
	if n, _ := res.RowsAffected(); n == 0 {
		if _, err := c.GetVolume(ctx, team, id); err != nil {
			return err
		}
		return fmt.Errorf("volume %q was mounted meanwhile: %w", id, errdefs.ErrFailedPrecondition)
	}
	return nil
}
