package catalog

import (
	"context"
	"fmt"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// CreateJoinToken records a one-time join token: id names it, secretHash
// is the SHA-256 (hex) of its secret, nodeID ("" = any) the node it is
// for; it expires after ttl by the database's clock.
func (c *Catalog) CreateJoinToken(ctx context.Context, id, secretHash, nodeID string, ttl time.Duration) error {
	if id == "" || secretHash == "" || ttl <= 0 {
		return fmt.Errorf("join token: id, secret and a positive ttl are required: %w", errdefs.ErrInvalidArgument)
	}
	now := c.nowMS()
	_, err := c.exec(ctx, `INSERT INTO join_tokens (id, secret_hash, node_id, created_ms, expires_ms, used_ms, used_by) VALUES (?, ?, ?, `+
		now+`, `+now+` + ?, 0, '')`, id, secretHash, nodeID, ttl.Milliseconds())
	return err
}

// UseJoinToken spends the token id for node nodeID if its secret hashes
// to secretHash, it is unused and unexpired, and it is for nodeID (or,
// unless onlyFor, any node). One UPDATE decides, so two replicas, or two callers, racing for
// one token cannot both spend it. Any failure is Unauthenticated and says
// no more (a caller guessing must not learn which part was wrong).
func (c *Catalog) UseJoinToken(ctx context.Context, id, secretHash, nodeID string, onlyFor bool) error {
	now := c.nowMS()
	res, err := c.exec(ctx, `UPDATE join_tokens SET used_ms = `+now+`, used_by = ? `+
		`WHERE id = ? AND secret_hash = ? AND used_ms = 0 AND expires_ms > `+now+` AND (node_id = ? OR (NOT ? AND node_id = ''))`,
		nodeID, id, secretHash, nodeID, onlyFor)
	if err != nil {
		return err
	}
	n, err := res.RowsAffected()
	if err != nil {
		return err
	}
	if n != 1 {
		return fmt.Errorf("join token %q: unknown, used, expired, wrong secret or for another node: %w", id, errdefs.ErrUnauthenticated)
	}
	return nil
}
