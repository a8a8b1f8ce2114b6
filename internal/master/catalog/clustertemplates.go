package catalog

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// ClusterTemplate is a template in a master's template store, as every
// replica of the catalog sees it.
type ClusterTemplate struct {
	ID        string
	Digest    string
	BlobBytes int64
	Source    string
	Runtime   string
	Warm      bool
	// Object is the object-store manifest ID of the image's blobs; ""
	// when only Replica holds them.
	Object    string
	Replica   string
	CreatedAt time.Time
}

const clusterTemplateCols = `id, digest, blob_bytes, source, runtime, warm, object, replica, created_ms`

func scanClusterTemplate(s interface{ Scan(...any) error }) (*ClusterTemplate, error) {
	var t ClusterTemplate
	var created int64
	if err := s.Scan(&t.ID, &t.Digest, &t.BlobBytes, &t.Source, &t.Runtime, &t.Warm, &t.Object, &t.Replica, &created); err != nil {
		return nil, err
	}
	t.CreatedAt = time.UnixMilli(created).UTC()
	return &t, nil
}

// PutClusterTemplate records t. The same ID again with the same digest
// is a no-op; with another digest it is ErrAlreadyExists (two replicas
// importing one ID at once: one row wins).
func (c *Catalog) PutClusterTemplate(ctx context.Context, t *ClusterTemplate) error {
	_, err := c.exec(ctx, `INSERT INTO cluster_templates (`+clusterTemplateCols+`) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)`,
		t.ID, t.Digest, t.BlobBytes, t.Source, t.Runtime, t.Warm, t.Object, t.Replica, t.CreatedAt.UnixMilli())
	if isDuplicate(err) {
		old, gerr := c.GetClusterTemplate(ctx, t.ID)
		if gerr == nil && old.Digest == t.Digest {
			return nil
		}
		return fmt.Errorf("template %q is in the cluster's store with another image: %w", t.ID, errdefs.ErrAlreadyExists)
	}
	return err
}

// GetClusterTemplate returns one record; ErrNotFound when there is none.
func (c *Catalog) GetClusterTemplate(ctx context.Context, id string) (*ClusterTemplate, error) {
	t, err := scanClusterTemplate(c.db.QueryRowContext(ctx, `SELECT `+clusterTemplateCols+` FROM cluster_templates WHERE id = ?`, id))
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("template %q is not in the cluster's store: %w", id, errdefs.ErrNotFound)
	}
	return t, err
}

// ListClusterTemplates returns every record, by ID.
func (c *Catalog) ListClusterTemplates(ctx context.Context) ([]*ClusterTemplate, error) {
	rows, err := c.db.QueryContext(ctx, `SELECT `+clusterTemplateCols+` FROM cluster_templates ORDER BY id`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []*ClusterTemplate
	for rows.Next() {
		t, err := scanClusterTemplate(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, t)
	}
	return out, rows.Err()
}

// DeleteClusterTemplate removes a record; a missing one is not an error.
func (c *Catalog) DeleteClusterTemplate(ctx context.Context, id string) error {
	_, err := c.exec(ctx, `DELETE FROM cluster_templates WHERE id = ?`, id)
	return err
}
