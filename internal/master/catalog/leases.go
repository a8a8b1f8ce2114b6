package catalog

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// Lease is the row of a named lease.
type Lease struct {
	Name    string
	Holder  string // the holding process; "" when never held or released
	Replica string // the holder's replica ID
	Token   int64  // fencing token: raised each time the holder changes
	// ExpiresAt is when another replica may take the lease, by the
	// database's clock.
	ExpiresAt time.Time
}

// nowMS is the database's clock in unix milliseconds: leases are timed by
// the one clock every replica shares, so a replica whose own clock is off
// can neither take a lease early nor keep it late.
func (c *Catalog) nowMS() string {
	if c.driver == MySQL {
		return `CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)`
	}
	return `CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)`
}

// AcquireLease takes or renews the lease name for holder (a process of
// replica) for ttl: it succeeds when the lease is free, expired, already
// held by holder, or, with takeOwn, held by another process of the same
// replica (a process starting takes over from its replica's earlier
// process, which is gone: a replica ID runs once at a time). The token is
// raised whenever the holder changes. ok is false when another holder has
// the lease; the returned Lease is the row as it stands.
func (c *Catalog) AcquireLease(ctx context.Context, name, holder, replica string, ttl time.Duration, takeOwn bool) (l Lease, ok bool, err error) {
	if holder == "" || replica == "" || ttl <= 0 {
		return Lease{}, false, fmt.Errorf("lease %q: holder, replica and a positive ttl are required: %w", name, errdefs.ErrInvalidArgument)
	}
	now := c.nowMS()
	res, err := c.exec(ctx, `UPDATE leases SET`+
		`
  token = CASE WHEN holder = ? THEN token ELSE token + 1 END,
  holder = ?, replica = ?, expires_at = `+now+` + ?
WHERE name = ? AND (holder = ? OR (? AND replica = ?) OR holder = '' OR expires_at < `+now+`)`,
		holder, holder, replica, ttl.Milliseconds(), name, holder, takeOwn, replica)
	if err != nil {
		return Lease{}, false, err
	}
	n, err := res.RowsAffected()
	if err != nil {
		return Lease{}, false, err
	}
	if n == 0 {
		// No row yet: the first replica ever creates it (a racing one
		// gets a duplicate and tries again at its next turn).
		l, gerr := c.GetLease(ctx, name)
		if errdefs.IsNotFound(gerr) {
			_, ierr := c.exec(ctx, `INSERT INTO leases (name, holder, replica, token, expires_at) VALUES (?, '', '', 0, 0)`, name)
			if ierr != nil && !isDuplicate(ierr) {
				return Lease{}, false, ierr
			}
			return c.AcquireLease(ctx, name, holder, replica, ttl, takeOwn)
		}
		return l, false, gerr
	}
	l, err = c.GetLease(ctx, name)
	if err != nil {
		return Lease{}, false, err
	}
	// Between the update and this read another holder may have taken an
	// expired lease: then it is theirs.
	return l, l.Holder == holder, nil
}

// GetLease reads the lease row.
func (c *Catalog) GetLease(ctx context.Context, name string) (Lease, error) {
	l := Lease{Name: name}
	var exp int64
	err := c.db.QueryRowContext(ctx, `SELECT holder, replica, token, expires_at FROM leases WHERE name = ?`, name).Scan(&l.Holder, &l.Replica, &l.Token, &exp)
	if errors.Is(err, sql.ErrNoRows) {
		return Lease{}, fmt.Errorf("lease %q: %w", name, errdefs.ErrNotFound)
	}
	if err != nil {
		return Lease{}, err
	}
	l.ExpiresAt = fromMS(exp)
	return l, nil
}

// CheckLease is the fencing check: nil while holder holds the lease with
// token and it has not expired by the database's clock, else
// FailedPrecondition. A singleton action calls it right before acting, so
// a replica that lost the lease (paused, partitioned) acts no more.
func (c *Catalog) CheckLease(ctx context.Context, name, holder string, token int64) error {
	var n int
	err := c.db.QueryRowContext(ctx, `SELECT COUNT(*) FROM leases WHERE name = ? AND holder = ? AND token = ? AND expires_at > `+c.nowMS(),
		name, holder, token).Scan(&n)
	if err != nil {
		return err
	}
	if n == 0 {
		return fmt.Errorf("lease %q: no longer held by %s with token %d: %w", name, holder, token, errdefs.ErrFailedPrecondition)
	}
	return nil
}

// ReleaseLease gives the lease up (a clean shutdown, the end of a move),
// so another holder takes it at once instead of after its expiry. The row
// and its token stay (the next holder raises it), and expires_at becomes
// the time of the release (PruneLeases).
func (c *Catalog) ReleaseLease(ctx context.Context, name, holder string) error {
	_, err := c.exec(ctx, `UPDATE leases SET holder = '', expires_at = `+c.nowMS()+` WHERE name = ? AND holder = ?`, name, holder)
	return err
}

// PruneLeases deletes the rows of the leases named prefix... that were
// released or expired more than age ago (database clock): for leases
// named per object (a sandbox's move), whose rows would otherwise pile
// up. A pruned lease starts again at token 1, so age must outlast
// anything that may still carry one of its tokens.
func (c *Catalog) PruneLeases(ctx context.Context, prefix string, age time.Duration) error {
	_, err := c.exec(ctx, `DELETE FROM leases WHERE SUBSTR(name, 1, ?) = ? AND expires_at < `+c.nowMS()+` - ?`,
		len(prefix), prefix, age.Milliseconds())
	return err
}

// LeaseHeld reads the lease row and says whether someone holds it now by
// the database's clock (a holder that stopped renewing holds it no more
// once it expired). A lease never taken is not held.
func (c *Catalog) LeaseHeld(ctx context.Context, name string) (Lease, bool, error) {
	l := Lease{Name: name}
	var exp int64
	var live int
	err := c.db.QueryRowContext(ctx, `SELECT holder, replica, token, expires_at, CASE WHEN holder <> '' AND expires_at > `+c.nowMS()+` THEN 1 ELSE 0 END FROM leases WHERE name = ?`,
		name).Scan(&l.Holder, &l.Replica, &l.Token, &exp, &live)
	if errors.Is(err, sql.ErrNoRows) {
		return Lease{Name: name}, false, nil
	}
	if err != nil {
		return Lease{}, false, err
	}
	l.ExpiresAt = fromMS(exp)
	return l, live == 1, nil
}

// HeldLeases is LeaseHeld for many names in one query: the leases among
// names that someone holds now, by name.
func (c *Catalog) HeldLeases(ctx context.Context, names []string) (map[string]Lease, error) {
	held := map[string]Lease{}
	const chunk = 500 // bound placeholders per statement
	for len(names) > 0 {
		n := min(len(names), chunk)
		if err := c.heldAmong(ctx, names[:n], held); err != nil {
			return nil, err
		}
		names = names[n:]
	}
	return held, nil
}

// heldAmong adds to held the leases among names held now.
func (c *Catalog) heldAmong(ctx context.Context, names []string, held map[string]Lease) error {
	args := make([]any, len(names))
	for i, name := range names {
		args[i] = name
	}
	rows, err := c.db.QueryContext(ctx, `SELECT name, holder, replica, token, expires_at FROM leases WHERE name IN (`+placeholders(len(names))+`) AND holder <> '' AND expires_at > `+c.nowMS(), args...) //nolint:gosec // G202: placeholders and the clock expression are constants
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var l Lease
		var exp int64
		if err := rows.Scan(&l.Name, &l.Holder, &l.Replica, &l.Token, &exp); err != nil {
			return err
		}
		l.ExpiresAt = fromMS(exp)
		held[l.Name] = l
	}
	return rows.Err()
}

// UpdateSandboxUnderLease is UpdateSandbox fenced by a lease: the row is
// written only while holder holds the lease name with token and it has
// not expired by the database's clock, checked in the same statement as
// the write, so a holder that lost the lease (another took it after its
// expiry) cannot write. Otherwise it returns CheckLease's
// FailedPrecondition and the row stays as it was.
func (c *Catalog) UpdateSandboxUnderLease(ctx context.Context, id, name, holder string, token int64, fn func(*Sandbox) error) (*Sandbox, error) {
	if err := c.CheckLease(ctx, name, holder, token); err != nil {
		return nil, err
	}
	guard := ` AND EXISTS (SELECT 1 FROM leases WHERE name = ? AND holder = ? AND token = ? AND expires_at > ` + c.nowMS() + `)`
	return c.updateSandbox(ctx, id, guard, []any{name, holder, token},
		func() error { return c.CheckLease(ctx, name, holder, token) }, fn)
}
