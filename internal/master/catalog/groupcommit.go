package catalog

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// Group commit (SQLite). The catalog's SQLite database has one connection
// and commits with synchronous=FULL, so every commit is an fsync of the
// WAL and commits run one after another: a burst of 100 creates, each
// with its row, its node, its state and its event, waited on 400 fsyncs in
// a row. Instead every write goes to one committer, which runs the writes
// queued when it is free in one transaction, each under its own SAVEPOINT
// (a write that fails is undone alone; the others stand), and commits the
// group once: one fsync for all of them. A write still returns only once
// the commit holding it is durable; a write that finds the committer idle
// runs at once, alone, as a plain transaction. The order is the same as
// one transaction after another: a write sees the writes before it in its
// group (a team quota counts the rows inserted just before).
//
// MySQL needs none of this: it has many connections, and InnoDB groups
// the commits of concurrent transactions into one log flush itself.

// maxGroup bounds how many writes share one commit, so that one group's
// transaction does not hold the connection (and every reader waiting for
// it) for long.
const maxGroup = 64

// errCatalogClosed answers a write made after Close.
var errCatalogClosed = fmt.Errorf("catalog: closed: %w", errdefs.ErrUnavailable)

// committer is the group-commit writer of a SQLite catalog.
type committer struct {
	// queue is unbuffered: a write handed over is always answered, and
	// the writes waiting to be handed over are the group's candidates.
	queue    chan *groupWrite
	stop     chan struct{}
	stopOnce sync.Once
	done     chan struct{}
	// commits counts the transactions committed, writes the writes
	// committed in them; waiting, the writes not yet handed over.
	commits, writes, waiting atomic.Int64
}

// groupWrite is one write waiting for its group.
type groupWrite struct {
	ctx  context.Context
	fn   func(*sql.Tx) error
	done chan writeResult
}

type writeResult struct {
	err error
	// panicked is what fn panicked with, re-raised in the caller's
	// goroutine: a panic belongs to the code that wrote fn.
	panicked any
}

// errPanicked stands for a write's panic inside the committer.
var errPanicked = errors.New("catalog: write panicked")

func (c *Catalog) startCommitter() {
	c.gc = &committer{queue: make(chan *groupWrite), stop: make(chan struct{}), done: make(chan struct{})}
	go c.commitLoop()
}

// stopCommitter answers the group in progress and stops taking writes.
func (c *Catalog) stopCommitter() {
	if c.gc == nil {
		return
	}
	c.gc.stopOnce.Do(func() { close(c.gc.stop) })
	<-c.gc.done
}

// GroupCommits reports how many commits the group committer made and how
// many writes they held (0, 0 on MySQL). writes/commits is the mean
// group size.
func (c *Catalog) GroupCommits() (commits, writes int64) {
	if c.gc == nil {
		return 0, 0
	}
	return c.gc.commits.Load(), c.gc.writes.Load()
}

// write hands fn to the committer and waits for the commit that holds it.
func (g *committer) write(ctx context.Context, fn func(*sql.Tx) error) error {
	w := &groupWrite{ctx: ctx, fn: fn, done: make(chan writeResult, 1)}
	g.waiting.Add(1)
	select {
	case g.queue <- w:
		g.waiting.Add(-1)
	case <-g.stop:
		g.waiting.Add(-1)
		return errCatalogClosed
	case <-ctx.Done():
		g.waiting.Add(-1)
		return ctx.Err()
	}
	r := <-w.done
	if r.panicked != nil {
		panic(r.panicked)
	}
	return r.err
}

func (c *Catalog) commitLoop() {
	g := c.gc
	defer close(g.done)
	group := make([]*groupWrite, 0, maxGroup)
	for {
		select {
		case <-g.stop:
			return
		default:
		}
		select {
		case <-g.stop:
			return
		case w := <-g.queue:
			group = append(group[:0], w)
		}
	take:
		for len(group) < maxGroup {
			select {
			case w := <-g.queue:
				group = append(group, w)
			default:
				break take
			}
		}
		c.commitGroup(group)
	}
}

// commitGroup runs one group and answers every write in it.
func (c *Catalog) commitGroup(group []*groupWrite) {
	live := group[:0]
	for _, w := range group {
		if err := w.ctx.Err(); err != nil {
			w.done <- writeResult{err: err}
			continue
		}
		live = append(live, w)
	}
	results := make([]writeResult, len(live))
	if len(live) <= 1 {
		// Alone: a plain transaction, no savepoint.
		c.alone(live, results, -1)
		return
	}
	// The group's transaction is not any one caller's: a caller that
	// goes away fails its own statements, not the group. It ends when
	// every caller in it has gone away (a group waiting for the
	// connection behind a long read gives up as its callers would).
	gctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	left := int64(len(live))
	stops := make([]func() bool, len(live))
	for i, w := range live {
		stops[i] = context.AfterFunc(w.ctx, func() {
			if atomic.AddInt64(&left, -1) == 0 {
				cancel()
			}
		})
	}
	defer func() {
		for _, stop := range stops {
			stop()
		}
	}()
	tx, err := c.db.BeginTx(gctx, nil)
	if err != nil {
		c.alone(live, results, -1)
		return
	}
	for i, w := range live {
		if _, err := tx.ExecContext(gctx, "SAVEPOINT w"); err != nil {
			_ = tx.Rollback()
			c.alone(live, results, -1)
			return
		}
		if err := guard(w.fn, &results[i].panicked)(tx); err != nil {
			results[i].err = err
			if _, err := tx.ExecContext(gctx, "ROLLBACK TO w"); err != nil {
				// SQLite rolled the whole transaction back itself (a
				// full disk, an I/O error, an interrupted statement):
				// the writes before this one are gone with it.
				_ = tx.Rollback()
				c.alone(live, results, i)
				return
			}
		}
		if _, err := tx.ExecContext(gctx, "RELEASE w"); err != nil {
			// The transaction ended under this write (SQLite ended it
			// and fn did not return the error, or fn ran a ROLLBACK of
			// its own; a write must never end the transaction itself):
			// unless fn failed on its own, it runs again alone too, so
			// that what its caller hears is what the database holds.
			_ = tx.Rollback()
			failed := -1
			if results[i].err != nil {
				failed = i
			}
			c.alone(live, results, failed)
			return
		}
	}
	// A failed commit fails every write that was in it; a write whose
	// own statements failed keeps its error (which may have come from
	// a write before it in the group, now not committed either).
	cerr := c.full(tx.Commit())
	ok := 0
	for i, w := range live {
		if results[i].err != nil {
			results[i].err = c.full(results[i].err)
		} else {
			results[i].err = cerr
			ok++
		}
		w.done <- results[i]
	}
	c.count(cerr, int64(ok))
}

// alone runs each write in a transaction of its own and answers it: a
// write that came alone, or the writes of a group whose transaction
// broke, where the write at failed (if any) keeps the error its own
// statements got and every other runs again.
func (c *Catalog) alone(live []*groupWrite, results []writeResult, failed int) {
	for i, w := range live {
		if i == failed {
			results[i].err = c.full(results[i].err)
		} else {
			results[i] = writeResult{}
			results[i].err = c.tx1(w.ctx, guard(w.fn, &results[i].panicked))
			c.count(results[i].err, 1)
		}
		w.done <- results[i]
	}
}

// count records a commit of n writes, when it succeeded.
func (c *Catalog) count(err error, n int64) {
	if err == nil {
		c.gc.commits.Add(1)
		c.gc.writes.Add(n)
	}
}

// guard runs fn, turning a panic into errPanicked (the transaction then
// undoes fn's statements) and keeping its value for the caller.
func guard(fn func(*sql.Tx) error, panicked *any) func(*sql.Tx) error {
	return func(tx *sql.Tx) (err error) {
		defer func() {
			if p := recover(); p != nil {
				*panicked = p
				err = fmt.Errorf("%w: %v", errPanicked, p)
			}
		}()
		return fn(tx)
	}
}
