package actions

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// Task is one flow's view of one sandbox: the typed record the actions
// fill in, what they need to know about the request, and the state of the
// flows that carry one. Actions of one step run in parallel, so every
// mutation of the record goes through Update.
type Task struct {
	store RecordWriter
	// publish makes each persisted record visible to readers (the core's
	// per-sandbox entry); nil when nobody reads.
	publish  func(*sandbox.Record)
	Template *sandbox.Template

	// The per-flow state; each is set by the verb entry point that runs
	// that flow and nil otherwise.
	//
	// Snapshot: the snapshot flow.
	Snapshot *SnapshotRun
	// Clone: the clone flow (the snapshot the new sandbox's disk and,
	// where it has one, memory come from).
	Clone *sandbox.Snapshot
	// Rollback: the rollback flow.
	Rollback *RollbackRun
	// DiskPause: the pause_disk and resume_disk flows.
	DiskPause *DiskPauseRun

	mu  sync.Mutex
	rec *sandbox.Record
	// initGone: a step found the sandbox's init dead (a resume whose
	// init was killed while frozen).
	initGone bool
}

// markInitGone records that the sandbox's init died during the flow.
func (t *Task) markInitGone() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.initGone = true
}

// InitGone reports whether a step of this flow found the sandbox's init
// dead.
func (t *Task) InitGone() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.initGone
}

// RecordWriter persists a sandbox record (the store).
type RecordWriter interface {
	PutSandbox(*sandbox.Record) error
}

// LazyRecordWriter persists a sandbox record in the background
// (store.PutSandboxLazy): the write returns before the record is on disk.
type LazyRecordWriter interface {
	PutSandboxLazy(*sandbox.Record) error
}

// NewTask starts a task on a copy of rec.
func NewTask(w RecordWriter, publish func(*sandbox.Record), rec *sandbox.Record, tmpl *sandbox.Template) *Task {
	return &Task{store: w, publish: publish, rec: rec.Clone(), Template: tmpl}
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
	if t.publish != nil {
		t.publish(snap)
	}
	return nil
}

// UpdateLazy is Update for a change a restarted cubelet finds out again
// from the runtime (a memory pause or resume: reconcile reads the
// runtime's state), so the caller need not wait for it to reach the
// disk: the record is published at once and written in the background
// where the store can (LazyRecordWriter), synchronously otherwise.
func (t *Task) UpdateLazy(fn func(r *sandbox.Record)) error {
	lw, ok := t.store.(LazyRecordWriter)
	if !ok {
		return t.Update(fn)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	fn(t.rec)
	t.rec.UpdatedAt = time.Now().UTC()
	snap := t.rec.Clone()
	if err := lw.PutSandboxLazy(snap); err != nil {
		return err
	}
	if t.publish != nil {
		t.publish(snap)
	}
	return nil
}

// source is the snapshot the sandbox's disk is cloned from in this flow
// (clone, rollback), nil otherwise.
func (t *Task) source() *sandbox.Snapshot {
	switch {
	case t.Clone != nil:
		return t.Clone
	case t.Rollback != nil:
		return t.Rollback.Snap
	}
	return nil
}

// SnapshotRun is the state of one snapshot flow.
type SnapshotRun struct {
	// Snap is the snapshot being written; the disk and memory actions
	// fill in its files.
	Snap *sandbox.Snapshot
	// Prev is the sandbox's state before the flow (Running or Paused).
	Prev lifecycle.State
	// Holds is what the flow holds on the live sandbox until a later step
	// or an undo gives it back.
	Holds Ledger
}

// RollbackRun is the state of one rollback flow.
type RollbackRun struct {
	// Snap is the snapshot the sandbox is put back to.
	Snap *sandbox.Snapshot
	// Prev is the sandbox's state before the flow.
	Prev lifecycle.State
	// Holds: Stopped once the container action has stopped the sandbox
	// on its old disk, Swapped while the disk files are exchanged.
	Holds Ledger
}

// DiskPauseRun is the state of one pause_disk or resume_disk flow.
type DiskPauseRun struct {
	// Image is the memory image directory.
	Image string
	// Holds: Quiesced while the agent is quiet and nothing has woken it.
	Holds Ledger
}

// state returns the snapshot flow's state; a snapshot action run without
// it is a programming error, reported instead of a nil dereference.
func snapshotRun(t *Task) (*SnapshotRun, error) {
	if t.Snapshot == nil || t.Snapshot.Snap == nil {
		return nil, fmt.Errorf("snapshot verb without a snapshot: %w", errdefs.ErrInternal)
	}
	return t.Snapshot, nil
}

func rollbackRun(t *Task) (*RollbackRun, error) {
	if t.Rollback == nil || t.Rollback.Snap == nil {
		return nil, fmt.Errorf("rollback verb without a snapshot: %w", errdefs.ErrInternal)
	}
	return t.Rollback, nil
}

func cloneSource(t *Task) (*sandbox.Snapshot, error) {
	if t.Clone == nil {
		return nil, fmt.Errorf("clone verb without a snapshot: %w", errdefs.ErrInternal)
	}
	return t.Clone, nil
}

func diskPauseRun(t *Task) (*DiskPauseRun, error) {
	if t.DiskPause == nil {
		return nil, fmt.Errorf("pause mode verb without its state: %w", errdefs.ErrInternal)
	}
	return t.DiskPause, nil
}

// Hold names one thing a flow has done to the live sandbox that must be
// given back before the flow ends.
type Hold string

const (
	// Frozen: the snapshot's container action paused a running container.
	// Given back by the thaw step, or the container action's undo.
	Frozen Hold = "frozen"
	// Checkpointed: the snapshot's memory action wrote the memory image
	// with a checkpoint that stopped the container (gVisor). Given back
	// by the thaw step, or the memory action's undo, restoring it in
	// place; that restore also wakes the agent and leaves it running, so
	// Quiesced and Frozen go with it.
	Checkpointed Hold = "checkpointed"
	// Quiesced: the agent was quiesced (snapshot: quiesce action;
	// pause_disk: checkpoint action) and nothing has woken it yet. Given
	// back by a restore from the image, or the taking action's undo.
	Quiesced Hold = "quiesced"
	// Stopped: the rollback's container action stopped the sandbox on its
	// old disk. Given back when its undo has the old sandbox answering.
	Stopped Hold = "stopped"
	// Swapped: the rollback exchanged the disk files. Given back by
	// exchanging them again.
	Swapped Hold = "swapped"
)

// Ledger is an explicit undo stack: an action that takes a Hold records
// it together with the function that gives it back; the step or undo that
// gives it back calls Release, which runs that function once and drops
// the entry. Where something else already gave it back (a restore woke
// the agent), Drop forgets it.
type Ledger struct {
	mu      sync.Mutex
	entries []ledgerEntry
}

type ledgerEntry struct {
	hold    Hold
	release func(ctx context.Context) error
}

// Take records h with the function that gives it back. Actions take a
// hold before the runtime call that may leave the sandbox in it, so a
// call that fails half-way is still given back.
func (l *Ledger) Take(h Hold, release func(ctx context.Context) error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.drop(h)
	l.entries = append(l.entries, ledgerEntry{hold: h, release: release})
}

// Holds reports whether h is held.
func (l *Ledger) Holds(h Hold) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.index(h) >= 0
}

// Release gives h back with the function recorded by Take; nothing when h
// is not held. On failure h stays held, so a later undo tries again.
func (l *Ledger) Release(ctx context.Context, h Hold) error {
	l.mu.Lock()
	i := l.index(h)
	if i < 0 {
		l.mu.Unlock()
		return nil
	}
	release := l.entries[i].release
	l.mu.Unlock()
	if release != nil {
		if err := release(ctx); err != nil {
			return err
		}
	}
	l.Drop(h)
	return nil
}

// Drop forgets h without running its release: something else gave it
// back.
func (l *Ledger) Drop(hs ...Hold) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, h := range hs {
		l.drop(h)
	}
}

func (l *Ledger) drop(h Hold) {
	if i := l.index(h); i >= 0 {
		l.entries = slices.Delete(l.entries, i, i+1)
	}
}

func (l *Ledger) index(h Hold) int {
	return slices.IndexFunc(l.entries, func(e ledgerEntry) bool { return e.hold == h })
}

// String lists what is held, oldest first.
func (l *Ledger) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var s []string
	for _, e := range l.entries {
		s = append(s, string(e.hold))
	}
	return strings.Join(s, ",")
}

// Stamp sets the record's creation time before it is first persisted.
func (t *Task) Stamp(at time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.rec.CreatedAt, t.rec.UpdatedAt = at, at
}
