package store

import (
	"errors"
	"fmt"
	"sync"

	bolt "go.etcd.io/bbolt"
)

// committer is a group commit: every write that arrives while a commit
// runs joins the next one, which starts as soon as that commit ends. A
// lone write commits at once (no batching delay), and n concurrent
// writes cost about two fsyncs, not n. bolt's own Batch does neither: it
// waits MaxBatchDelay before each commit, and a batch whose delay expired
// while another commit held the file closes without the writes arriving
// behind it, so writes during a slow fsync commit one batch each, one
// after another (a burst of 50 creates paid 100 fsyncs in a row).
type committer struct {
	mu      sync.Mutex
	pending []call
	busy    bool // a commitLoop runs
	commits uint64
}

type call struct {
	fn  func(*bolt.Tx) error
	err chan error
}

// errSolo tells a caller whose function failed inside a group to run it
// in a transaction of its own (its error may depend on the others).
var errSolo = errors.New("store: rerun alone")

// write runs fn in a write transaction shared with the writes in flight.
// As with bolt's Batch, fn may run more than once and must not depend on
// state outside the transaction.
func (s *Store) write(fn func(*bolt.Tx) error) error {
	c := call{fn: fn, err: make(chan error, 1)}
	g := &s.group
	g.mu.Lock()
	g.pending = append(g.pending, c)
	lead := !g.busy
	g.busy = true
	g.mu.Unlock()
	if lead {
		go s.commitLoop()
	}
	err := <-c.err
	if errors.Is(err, errSolo) {
		err = s.db.Update(func(tx *bolt.Tx) error { return safeCall(fn, tx) })
	}
	return err
}

// commitLoop commits the pending writes, group after group, until none
// are left.
func (s *Store) commitLoop() {
	g := &s.group
	for {
		g.mu.Lock()
		calls := g.pending
		g.pending = nil
		if len(calls) == 0 {
			g.busy = false
			g.mu.Unlock()
			return
		}
		g.commits++
		g.mu.Unlock()
		s.commitGroup(calls)
	}
}

// commitGroup runs calls in one transaction. A call that fails is taken
// out (and told to run alone) and the rest run again, so one write's
// error never fails another's.
func (s *Store) commitGroup(calls []call) {
	for len(calls) > 0 {
		failed := -1
		err := s.db.Update(func(tx *bolt.Tx) error {
			for i, c := range calls {
				if err := safeCall(c.fn, tx); err != nil {
					failed = i
					return err
				}
			}
			return nil
		})
		if failed >= 0 {
			calls[failed].err <- errSolo
			calls = append(calls[:failed:failed], calls[failed+1:]...)
			continue
		}
		for _, c := range calls {
			c.err <- err
		}
		return
	}
}

// safeCall runs fn, turning a panic into an error (the commit loop serves
// every writer: one panicking function must not take the others down).
func safeCall(fn func(*bolt.Tx) error, tx *bolt.Tx) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("store: write panicked: %v", p)
		}
	}()
	return fn(tx)
}
