// Package catalog is cubemaster's SQL catalog: nodes and the templates they
// hold, sandboxes with their metadata, deadlines and events, snapshots, and
// API keys.
//
// One schema serves SQLite (modernc.org/sqlite, embedded, the default) and
// MySQL/MariaDB (github.com/go-sql-driver/mysql): the migrations under
// migrations/ are written in the SQL both accept, and the Go code avoids
// dialect-specific statements (no upsert syntax, no RETURNING, no
// AUTO_INCREMENT). Times are unix milliseconds.
//
// Concurrent writers of one sandbox row use optimistic concurrency: every
// row has a version, and Update retries when another writer got there first.
package catalog

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/go-sql-driver/mysql"
	"modernc.org/sqlite" // registers the "sqlite" driver
	sqlite3 "modernc.org/sqlite/lib"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// Drivers the catalog supports.
const (
	SQLite = "sqlite"
	MySQL  = "mysql"
)

// Catalog is an open catalog database.
type Catalog struct {
	db     *sql.DB
	driver string
	dir    string // SQLite: the file's directory, the filesystem a full-disk error names
	// retried counts transactions run again after a deadlock or a lock
	// wait timeout.
	retried atomic.Int64
	// gc is SQLite's group committer (groupcommit.go); nil on MySQL.
	gc *committer
}

// Retried is how many transactions were run again after MySQL aborted
// them for a deadlock or a lock wait timeout.
func (c *Catalog) Retried() int64 { return c.retried.Load() }

// Open connects to the database and applies every pending migration.
//
// For SQLite, dsn is a file path (its directory is created); the database
// runs in WAL mode with one connection, so writers never see SQLITE_BUSY,
// and synchronous=FULL: a commit returns only once the WAL is fsynced, so
// a write the master acknowledged to a client survives a crash of the
// machine, not only of the process (NORMAL may lose the last commits).
// For MySQL, dsn is a go-sql-driver DSN (user:pass@tcp(host:3306)/cube);
// clientFoundRows is forced on so UPDATE reports matched rows, as SQLite does.
func Open(ctx context.Context, driver, dsn string) (*Catalog, error) {
	var db *sql.DB
	var dir string
	switch driver {
	case SQLite:
		if dsn == "" {
			return nil, fmt.Errorf("catalog: sqlite needs a file path: %w", errdefs.ErrInvalidArgument)
		}
		path, _, _ := strings.Cut(strings.TrimPrefix(dsn, "file:"), "?")
		dir = filepath.Dir(path)
		if path != ":memory:" {
			if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
				return nil, err
			}
		}
		var err error
		db, err = sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_pragma=synchronous(FULL)")
		if err != nil {
			return nil, err
		}
		// One connection: SQLite has one writer anyway, and a single
		// connection turns lock upgrades into waits in Go, not errors.
		db.SetMaxOpenConns(1)
	case MySQL:
		cfg, err := mysql.ParseDSN(dsn)
		if err != nil {
			return nil, fmt.Errorf("catalog: mysql dsn: %v: %w", err, errdefs.ErrInvalidArgument)
		}
		cfg.ClientFoundRows = true
		cfg.ParseTime = false
		conn, err := mysql.NewConnector(cfg)
		if err != nil {
			return nil, err
		}
		db = sql.OpenDB(conn)
		db.SetMaxOpenConns(16)
		db.SetConnMaxLifetime(5 * time.Minute)
	default:
		return nil, fmt.Errorf("catalog: driver %q: want %s or %s: %w", driver, SQLite, MySQL, errdefs.ErrInvalidArgument)
	}
	c := &Catalog{db: db, driver: driver, dir: dir}
	if err := db.PingContext(ctx); err != nil {
		db.Close()
		return nil, fmt.Errorf("catalog: connect: %v: %w", err, errdefs.ErrUnavailable)
	}
	if driver == SQLite {
		c.startCommitter()
	}
	if err := c.migrate(ctx); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// Close answers the writes in progress and closes the database; later
// writes fail.
func (c *Catalog) Close() error {
	c.stopCommitter()
	return c.db.Close()
}

// Driver is the database driver in use.
func (c *Catalog) Driver() string { return c.driver }

// Durability reports SQLite's journal_mode and synchronous level as the
// open connection has them ("wal", 2 = FULL); MySQL: "", -1 (the server's
// settings decide).
func (c *Catalog) Durability(ctx context.Context) (journal string, synchronous int, err error) {
	if c.driver != SQLite {
		return "", -1, nil
	}
	if err := c.db.QueryRowContext(ctx, "PRAGMA journal_mode").Scan(&journal); err != nil {
		return "", 0, err
	}
	if err := c.db.QueryRowContext(ctx, "PRAGMA synchronous").Scan(&synchronous); err != nil {
		return "", 0, err
	}
	return journal, synchronous, nil
}

// Ping checks the database answers.
func (c *Catalog) Ping(ctx context.Context) error { return c.db.PingContext(ctx) }

// txAttempts bounds how often tx runs a transaction that MySQL aborted
// for a deadlock or a lock wait timeout.
var txAttempts = 6

// tx runs fn in a transaction, committing when it returns nil. On SQLite
// the transaction may be shared with other writes (groupcommit.go): fn's
// statements are undone alone when it fails. A MySQL
// transaction chosen as a deadlock's victim (InnoDB rolls it back whole)
// or timed out waiting for a lock is rolled back and run again, after a
// short random pause, up to txAttempts times: concurrent transactions
// (two kills: each deletes a tombstone that is not there, which locks the
// gap, then inserts into it) deadlock by design in InnoDB, which expects
// the application to retry. fn must not keep state across attempts.
func (c *Catalog) tx(ctx context.Context, fn func(*sql.Tx) error) error {
	if c.gc != nil {
		return c.gc.write(ctx, fn)
	}
	for attempt := 1; ; attempt++ {
		err := c.tx1(ctx, fn)
		if !retryable(err) || attempt >= txAttempts {
			return err
		}
		c.retried.Add(1)
		select {
		case <-ctx.Done():
			return errors.Join(err, ctx.Err())
		case <-time.After(time.Duration(attempt) * time.Duration(1+rand.IntN(10)) * time.Millisecond): //nolint:gosec // G404: jitter, not a secret
		}
	}
}

func (c *Catalog) tx1(ctx context.Context, fn func(*sql.Tx) error) error {
	tx, err := c.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	if err := fn(tx); err != nil {
		_ = tx.Rollback()
		return c.full(err)
	}
	return c.full(tx.Commit())
}

// retryable reports whether err is MySQL's deadlock (1213) or lock wait
// timeout (1205).
func retryable(err error) bool {
	var me *mysql.MySQLError
	return errors.As(err, &me) && (me.Number == 1213 || me.Number == 1205)
}

func ms(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixMilli()
}

func fromMS(v int64) time.Time {
	if v == 0 {
		return time.Time{}
	}
	return time.UnixMilli(v).UTC()
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// isDuplicate reports whether err is a unique-key violation, in either
// dialect.
func isDuplicate(err error) bool {
	if err == nil {
		return false
	}
	var me *mysql.MySQLError
	if errors.As(err, &me) {
		return me.Number == 1062
	}
	var se *sqlite.Error
	if errors.As(err, &se) {
		return se.Code() == sqlite3.SQLITE_CONSTRAINT_UNIQUE || se.Code() == sqlite3.SQLITE_CONSTRAINT_PRIMARYKEY
	}
	return false
}

// placeholders returns "?, ?, ?" for n values.
func placeholders(n int) string {
	return strings.TrimSuffix(strings.Repeat("?, ", n), ", ")
}
