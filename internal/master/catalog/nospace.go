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

// exec is one write statement in a transaction of its own (on SQLite one
// the group committer may share), with full's classification.
func (c *Catalog) exec(ctx context.Context, query string, args ...any) (sql.Result, error) {
	if c.gc == nil {
		res, err := c.db.ExecContext(ctx, query, args...)
		return res, c.full(err)
	}
	var res sql.Result
	err := c.tx(ctx, func(tx *sql.Tx) error {
		var err error
		res, err = tx.ExecContext(ctx, query, args...)
		return err
	})
	return res, c.full(err)
}
