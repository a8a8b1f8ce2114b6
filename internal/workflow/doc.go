// Package workflow is cubelet's workflow engine: it runs named flows of
// pluggable actions, in ordered steps, with rollback, per-flow concurrency
// limits, timings and metrics.
//
// # Terms
//
// An Action is a named plugin ("disk.clone", "net.slot", "runtime.start")
// registered once in a Registry at start-up. Its base interface is only
// Name(); it implements whichever capability interfaces it supports (a
// creator, an undoer, a destroyer, later a snapshotter), in the manner of
// Nomad's runner hooks. One Action value serves every run concurrently, so it
// keeps no per-run state: that lives in the task T.
//
// T is the per-run task type the engine is instantiated with (cubelet uses
// *actions.Task, which holds the typed sandbox record and the verb's own
// typed state). Actions read and write it; there are no interface{} bags
// between actions.
//
// A Verb[T] makes a capability callable: it names the verb ("create",
// "destroy", "init"), says which actions support it (usually a type
// assertion, see Implements), how to call it and, for Forward verbs, how to
// undo one action. Verbs are supplied to New, so new verbs (snapshot, clone,
// rollback) need no change to the engine.
//
// A flow is the configured list of steps for one verb; the flow has the
// verb's name. A step is a list of action names that run in parallel; steps
// run in order.
//
// # Modes
//
//	Forward   steps in order; all actions of a step run to completion even
//	          if one fails; the first failing step stops the flow and every
//	          action started so far (completed AND failed, which may have
//	          done partial work) is undone in exact reverse order: last step
//	          first, within a step reverse declaration order, one at a time,
//	          under context.WithoutCancel. Undo errors are joined; the
//	          returned error wraps the original error and, when some undo
//	          failed, ErrUndoIncomplete and the undo errors.
//	Teardown  every step runs, in order, whatever fails; all errors joined.
//	Init      like Forward without undo; T may be a zero value.
//
// Hence the contract for an Undo: idempotent, harmless without a prior do
// (the failure may have happened before the action did anything), and it
// must tolerate a cancelled parent (it gets a context without cancellation).
//
//	step 1: [disk.clone  net.slot]   ok  ok
//	step 2: [disk.mount]             ok
//	step 3: [runtime.start]          FAIL
//	undo:   runtime.start, disk.mount, net.slot, disk.clone
//
// A panic in an action (or its undo) is recovered into an error naming the
// action.
//
// # Configuration
//
// Flows are declared in the daemon's TOML config, which embeds Config:
//
//	[flows.init]
//	steps = [["store.open"], ["net.pool", "disk.pool"]]
//
//	[flows.create]
//	limit = 10          # concurrent runs; 0 = unlimited
//	queue = "10s"       # how long a run over the limit waits for a slot
//	steps = [["disk.clone", "net.slot"], ["disk.mount"], ["runtime.start"], ["agent.wait"]]
//
//	[flows.destroy]
//	steps = [["agent.stop"], ["runtime.stop"], ["disk.unmount", "net.release"]]
//
// New validates everything up front, so a typo refuses to start the daemon:
//
//	workflow: flow "create" step 2: unknown action "disk.clon"
//
// # Running
//
// Run(ctx, "create", task) takes a slot from the flow's limiter: over the
// limit it waits up to the flow's queue time (queue = "10s"; not in
// arrival order) for a slot to free, then fails with
// errdefs.ErrResourceExhausted; with no queue it fails at once. An unknown
// flow is errdefs.ErrNotFound. Limits are hot-tunable with SetLimit, and Reload swaps a whole validated config
// atomically; runs already in flight keep the steps they started with.
//
// Every action's do and undo is timed into the Result and, with WithMetrics,
// exported as Prometheus histograms.
//
// # Failpoints
//
// With WithFailpoints(true) the engine evaluates, through package failpoint,
// "<flow>/<action>" before an action's do, "<flow>/<action>/after" after it
// did its work (so the undo path must clean up), and "<flow>/<action>/undo"
// before its undo. Tests and a daemon's CUBE_FAILPOINTS use these to drive
// every rollback path.
package workflow
