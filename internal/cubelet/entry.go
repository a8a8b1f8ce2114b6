package cubelet

import (
	"context"
	"sync/atomic"

	"github.com/cubesandbox/cube/internal/cubelet/actions"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/store"
)

// entry is the in-memory handle of one sandbox: its lock and the last
// persisted record. Readers (Get, List) never take the lock: they read
// rec, which flows replace on every Task.Update.
type entry struct {
	lock chan struct{} // one token: held for the whole of a flow
	rec  atomic.Pointer[sandbox.Record]
	// onPublish sees every record a flow persists (the runtime watch
	// follows the PID in it); nil = nothing.
	onPublish func(*sandbox.Record)
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

// The store is what tasks persist records to.
var (
	_ actions.RecordWriter     = (*store.Store)(nil)
	_ actions.LazyRecordWriter = (*store.Store)(nil)
)

// newTask starts a flow's task on rec; every record it persists becomes
// e's (when e is set).
func newTask(w actions.RecordWriter, e *entry, rec *sandbox.Record, tmpl *sandbox.Template) *actions.Task {
	var publish func(*sandbox.Record)
	if e != nil {
		publish = func(r *sandbox.Record) {
			e.rec.Store(r)
			if e.onPublish != nil {
				e.onPublish(r)
			}
		}
	}
	return actions.NewTask(w, publish, rec, tmpl)
}

// detached is ctx without its cancellation but with its deadline, for a
// verb's flow once it has begun changing a sandbox: the flow finishes (or
// undoes) its work even when the caller goes away. A cubemaster killed
// mid-call cancels the call's context, and a runtime command killed
// half-way (runsc checkpoint, a QMP migration) can leave the sandbox
// unable to resume, so the verb's undo fails and the sandbox is lost.
func detached(ctx context.Context) (context.Context, context.CancelFunc) {
	d := context.WithoutCancel(ctx)
	if dl, ok := ctx.Deadline(); ok {
		return context.WithDeadline(d, dl)
	}
	return context.WithCancel(d)
}
