package cubelet

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cubesandbox/cube/internal/sandbox"
)

// The capabilities an action may implement. An action implements only
// what it needs; the flow's verb decides which method runs, and an action
// named in a flow it cannot serve stops the daemon at start-up.
type (
	// Initializer runs once in the init flow, before the API serves.
	Initializer interface {
		Init(ctx context.Context) error
	}
	// Creator acquires a resource for a new sandbox. It must record the
	// resource in the task (Task.Update) BEFORE creating it.
	Creator interface {
		Create(ctx context.Context, t *Task) error
	}
	// Destroyer releases what Create acquired. It is the undo of a failed
	// create and the body of destroy and cleanup, so it must be idempotent
	// and harmless when Create never ran or only half ran.
	Destroyer interface {
		Destroy(ctx context.Context, t *Task) error
	}
	Pauser interface {
		Pause(ctx context.Context, t *Task) error
	}
	Resumer interface {
		Resume(ctx context.Context, t *Task) error
	}
)

// Task is one flow's view of one sandbox: the typed record the actions
// fill in, plus what they need to know about the request. Actions of one
// step run in parallel, so every mutation goes through Update.
type Task struct {
	store    recordWriter
	entry    *entry
	Template *sandbox.Template
	// snap is the snapshot verbs' state (snapshot, clone, rollback); nil
	// for the other flows.
	snap *snapOp
	// pause is the pause-to-disk / resume-from-disk state (pausemode.go).
	pause *pauseOp

	mu  sync.Mutex
	rec *sandbox.Record
}

type recordWriter interface {
	PutSandbox(*sandbox.Record) error
}

func newTask(w recordWriter, e *entry, rec *sandbox.Record, tmpl *sandbox.Template) *Task {
	return &Task{store: w, entry: e, rec: rec.Clone(), Template: tmpl}
}

// Record returns a copy of the current record.
func (t *Task) Record() *sandbox.Record {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.rec.Clone()
}

// Update mutates the record and persists it before returning, so that
// what fn records is durable before the caller acts on it.
func (t *Task) Update(fn func(r *sandbox.Record)) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	fn(t.rec)
	t.rec.UpdatedAt = time.Now().UTC()
	snap := t.rec.Clone()
	if err := t.store.PutSandbox(snap); err != nil {
		return err
	}
	if t.entry != nil {
		t.entry.rec.Store(snap)
	}
	return nil
}

// entry is the in-memory handle of one sandbox: its lock and the last
// persisted record. Readers (Get, List) never take the lock: they read
// rec, which flows replace on every Update.
type entry struct {
	lock chan struct{} // one token: held for the whole of a flow
	rec  atomic.Pointer[sandbox.Record]
}

func newEntry(rec *sandbox.Record) *entry {
	e := &entry{lock: make(chan struct{}, 1)}
	e.rec.Store(rec.Clone())
	return e
}

// acquire takes the sandbox's lock, honouring ctx so a caller stuck
// behind a long flow on the same sandbox can give up.
func (e *entry) acquire(ctx context.Context) error {
	select {
	case e.lock <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (e *entry) release() { <-e.lock }
