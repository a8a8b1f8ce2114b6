package store

import (
	"context"
	"encoding/json"
	"log/slog"
	"sync"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/nospace"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// fpFlush is evaluated by the background writer before it commits the
// records PutSandboxLazy queued: a test that hangs it and SIGKILLs the
// daemon crashes it after a verb answered and before its record is on disk.
var fpFlush = failpoint.Register("store/sandbox-flush")

// lazyRetry is how long the background writer waits before retrying a
// commit that failed (a full filesystem).
const lazyRetry = 100 * time.Millisecond

// lazyWriter holds the sandbox records written with PutSandboxLazy and not
// yet committed, and the goroutine that commits them. The records it
// holds are ones the node's runtime can tell again (see PutSandboxLazy),
// so the queue lives in memory only.
type lazyWriter struct {
	mu      sync.Mutex
	seq     uint64
	pending map[string]lazyRecord
	kick    chan struct{} // one token: a record is waiting
	stop    context.CancelFunc
	done    chan struct{}
	log     *slog.Logger
}

type lazyRecord struct {
	seq  uint64
	data []byte
}

func newLazyWriter(log *slog.Logger) *lazyWriter {
	return &lazyWriter{pending: map[string]lazyRecord{}, kick: make(chan struct{}, 1), done: make(chan struct{}), log: log}
}

// PutSandboxLazy records r like PutSandbox but returns before the record
// is on disk: a background writer commits it at once (records queued
// while a commit runs share the next one). Readers of this Store see it
// at once. A crash before the commit loses it, so it is only for
// records whose difference from the previous one the node can find out
// again on restart: a memory pause or resume, whose outcome is the
// runtime's own state (the cgroup freezer, which restart reconcile
// reads), or a warm pool claim's running record (its synchronous
// creating record with the entry's token makes reconcile finish the
// claim). Any synchronous write of the same sandbox made later replaces
// it, even when the background writer has not committed it yet.
func (s *Store) PutSandboxLazy(r *sandbox.Record) error {
	data, err := json.Marshal(r) //nolint:gosec // G117: as CreateSandbox
	if err != nil {
		return err
	}
	l := s.lazy
	l.mu.Lock()
	l.seq++
	l.pending[r.ID] = lazyRecord{seq: l.seq, data: data}
	l.mu.Unlock()
	select {
	case l.kick <- struct{}{}:
	default:
	}
	return nil
}

// run commits queued records until ctx ends, then commits what is left.
func (l *lazyWriter) run(ctx context.Context, s *Store) {
	defer close(l.done)
	for {
		select {
		case <-l.kick:
		case <-ctx.Done():
			if err := l.commit(s); err != nil {
				l.log.Error("state store: records of paused and resumed sandboxes not written at close", "err", err)
			}
			return
		}
		for l.flush(ctx, s) != nil {
			select {
			case <-time.After(lazyRetry):
			case <-ctx.Done():
			}
			if ctx.Err() != nil {
				break
			}
		}
	}
}

// flush commits every queued record in one transaction. The queue is read
// inside the transaction: a synchronous write that supersedes a record
// (supersede) either ran before it, and the record is gone from the
// queue, or runs after its commit, and overwrites it.
func (l *lazyWriter) flush(ctx context.Context, s *Store) error {
	if err := fpFlush.Eval(ctx); err != nil {
		return err
	}
	return l.commit(s)
}

func (l *lazyWriter) commit(s *Store) error {
	var taken map[string]uint64
	err := s.db.Update(func(tx *bolt.Tx) error {
		l.mu.Lock()
		defer l.mu.Unlock()
		taken = make(map[string]uint64, len(l.pending))
		b := tx.Bucket(bucketSandboxes)
		for id, p := range l.pending {
			if err := b.Put([]byte(id), p.data); err != nil {
				return err
			}
			taken[id] = p.seq
		}
		return nil
	})
	if err != nil {
		err = nospace.Wrap(err, s.dir)
		l.log.Warn("state store: write records of paused and resumed sandboxes", "err", err)
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for id, seq := range taken {
		if l.pending[id].seq == seq {
			delete(l.pending, id)
		}
	}
	return nil
}

// supersede drops the queued records of ids before a synchronous write of
// those sandboxes, so the background writer cannot put an older record
// over it; restore puts them back when that write failed.
func (l *lazyWriter) supersede(ids ...string) (restore func()) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var dropped map[string]lazyRecord
	for _, id := range ids {
		if p, ok := l.pending[id]; ok {
			if dropped == nil {
				dropped = map[string]lazyRecord{}
			}
			dropped[id] = p
			delete(l.pending, id)
		}
	}
	return func() {
		if dropped == nil {
			return
		}
		l.mu.Lock()
		defer l.mu.Unlock()
		for id, p := range dropped {
			if _, newer := l.pending[id]; !newer {
				l.pending[id] = p
			}
		}
	}
}

// syncSandboxes runs a synchronous write of the sandboxes ids in fn,
// superseding their queued records.
func (s *Store) syncSandboxes(fn func(*bolt.Tx) error, ids ...string) error {
	restore := s.lazy.supersede(ids...)
	err := s.batch(fn)
	if err != nil {
		restore()
	}
	return err
}

// queued returns the queued record of id.
func (l *lazyWriter) queued(id string) ([]byte, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	p, ok := l.pending[id]
	return p.data, ok
}

// queuedAll returns every queued record by sandbox ID.
func (l *lazyWriter) queuedAll() map[string][]byte {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make(map[string][]byte, len(l.pending))
	for id, p := range l.pending {
		out[id] = p.data
	}
	return out
}
