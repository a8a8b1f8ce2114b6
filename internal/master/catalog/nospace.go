package catalog

import (
	"context"
	"database/sql"

	"github.com/cubesandbox/cube/internal/nospace"
)

// full turns a full disk under the catalog (SQLITE_FULL: "database or
// disk is full", or ENOSPC) into an errdefs.ErrNoSpace naming the
// filesystem, so the API answers 507 with where space is short. SQLite
// rolls the statement or transaction back whole: nothing is half-written,
// and the same write succeeds once space returns.
func (c *Catalog) full(err error) error {
	if c.dir == "" {
		return nospace.Wrap(err)
	}
	return nospace.Wrap(err, c.dir)
}

// exec is ExecContext outside a transaction, with full's classification.
func (c *Catalog) exec(ctx context.Context, query string, args ...any) (sql.Result, error) {
	res, err := c.db.ExecContext(ctx, query, args...)
	return res, c.full(err)
}
