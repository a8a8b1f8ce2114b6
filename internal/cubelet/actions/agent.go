package actions

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet/agentclient"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/procstate"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// agentAction waits until cube-agent answers /health inside the sandbox:
// a sandbox is Running only when its agent is (create, resume, clone,
// rollback). A clone restored from memory, and every VM, has its agent
// re-initialised with its own identity.
type agentAction struct{ n *Node }

func (*agentAction) Name() string { return "agent" }

// Create waits for the agent; a VM's is then given its environment (its
// kernel starts it with none). Then the template's service starts.
func (a *agentAction) Create(ctx context.Context, t *Task) error {
	if err := a.wait(ctx, t); err != nil {
		return err
	}
	if a.n.BootsDisk(t.Record().Runtime) {
		if err := a.n.reinitAgent(ctx, t); err != nil {
			return err
		}
	}
	return a.n.startService(ctx, t)
}

// Resume waits for the agent again, except after a memory resume on a
// runtime whose pause is a freeze in place (Capabilities.PauseFreezes):
// there the agent is the sandbox's init, it answered before the pause,
// and the thaw gave it back as it was, listening socket included. Asking
// it again would only add a round-trip (about 1 ms) to every resume;
// what the freezer cannot guarantee, that the init still exists, is
// checked instead, in the sandbox's cgroup (an init gone since is what
// the runtime watch reports).
func (a *agentAction) Resume(ctx context.Context, t *Task) error {
	rec := t.Record()
	if d, err := a.n.Driver(rec.Runtime); err == nil && d.Capabilities().PauseFreezes &&
		rec.PauseMode != sandbox.PauseDisk && rec.Container != nil && rec.Container.PID > 0 {
		// In the sandbox's cgroup: a PID freed by a dead init and reused
		// by another process does not pass.
		live, err := procstate.Alive(rec.Container.PID, rec.Container.CgroupPath)
		if err != nil {
			return a.wait(ctx, t)
		}
		if !live {
			t.markInitGone()
			return a.n.withConsole(rec, fmt.Errorf("agent: sandbox init (pid %d) is gone: %w", rec.Container.PID, errdefs.ErrUnavailable))
		}
		return nil
	}
	return a.wait(ctx, t)
}

// Destroy has nothing to release: the agent dies with the container.
func (a *agentAction) Destroy(context.Context, *Task) error { return nil }

// Clone waits for the clone's agent and, when the clone was restored from
// memory (it then holds the original's identity), re-initialises it.
func (a *agentAction) Clone(ctx context.Context, t *Task) error {
	d, err := a.n.Driver(t.Record().Runtime)
	if err != nil {
		return err
	}
	if _, ok := d.(runtime.AgentWaker); ok && memoryImage(d, t) != "" {
		// Restored with a quiesced agent: launch woke it once; wake it
		// again until it answers, in case that signal went astray.
		err = a.n.wakeAgent(ctx, t.Record())
	} else {
		err = a.wait(ctx, t)
	}
	if err != nil {
		return err
	}
	if memoryImage(d, t) == "" && !d.Capabilities().BootsDisk {
		return a.n.startService(ctx, t)
	}
	if err := a.n.reinitAgent(ctx, t); err != nil {
		return err
	}
	return a.n.startService(ctx, t)
}

// heldToken is the access token the sandbox's agent holds right after
// launch: the snapshot's when it was restored from a memory image (clone,
// rollback), its own otherwise (a cold boot got its verifier in the spec).
func heldToken(d runtime.Driver, t *Task) string {
	if memoryImage(d, t) != "" {
		return t.source().AccessToken
	}
	return t.Record().AccessToken
}

// Rollback waits for the agent of the re-rooted sandbox.
// A VM also re-syncs its clock: its memory image stopped the guest's time
// when the snapshot was taken. An agent restored from a snapshot taken
// under another token is given the sandbox's own.
func (a *agentAction) Rollback(ctx context.Context, t *Task) error {
	if err := a.wait(ctx, t); err != nil {
		return err
	}
	d, err := a.n.Driver(t.Record().Runtime)
	if err != nil {
		return err
	}
	if d.Capabilities().BootsDisk || heldToken(d, t) != t.Record().AccessToken {
		return a.n.reinitAgent(ctx, t)
	}
	return nil
}

// UndoRollback has nothing to undo; the container's undo waits for the
// old sandbox's agent itself.
func (a *agentAction) UndoRollback(context.Context, *Task) error { return nil }

func (a *agentAction) wait(ctx context.Context, t *Task) error {
	rec := t.Record()
	ctx, cancel := a.n.agentWait(ctx, rec)
	defer cancel()
	err := withWaitCause(ctx, a.n.waitAgent(ctx, rec))
	if err != nil && rec.Container != nil {
		return a.n.withConsole(rec, err)
	}
	if err == nil {
		a.n.sealConsole(ctx, rec)
	}
	return err
}

// waitAgent polls the sandbox's agent /health until it answers.
func (n *Node) waitAgent(ctx context.Context, rec *sandbox.Record) error {
	d, err := n.Driver(rec.Runtime)
	if err != nil {
		return err
	}
	return agentclient.Wait(ctx, d, rec)
}

// wakeAgent wakes a quiesced agent and waits until it answers /health
// (only waits where the runtime needs no quiesce).
func (n *Node) wakeAgent(ctx context.Context, rec *sandbox.Record) error {
	d, err := n.Driver(rec.Runtime)
	if err != nil {
		return err
	}
	ctx, cancel := n.agentWait(ctx, rec)
	defer cancel()
	// agentWait's budget bounds the wait, not Wake's own timeout.
	return withWaitCause(ctx, agentclient.Wake(ctx, d, rec, 24*time.Hour))
}

// sessionSparer is a driver whose agent channel can set up the session
// of its next call ahead of time (a VM's virtio-serial handshake).
type sessionSparer interface {
	SpareAgentSession(ctx context.Context, id string) error
}

var _ sessionSparer = (*vmRuntime)(nil)

// PrepareAgent has the agent of rec, a warm-pool entry about to be frozen,
// build what a user's first call needs (agentclient.Prepare), so that the
// claim does not.
func PrepareAgent(ctx context.Context, d runtime.Driver, rec *sandbox.Record) error {
	return agentclient.Prepare(ctx, d, rec)
}

// SpareAgentSession has the agent channel of rec, a warm-pool entry about
// to be frozen, set up the session its claim's reinit will use, where the
// channel has sessions (a VM's virtio-serial); elsewhere it does nothing.
func SpareAgentSession(ctx context.Context, d runtime.Driver, rec *sandbox.Record) error {
	s, ok := d.(sessionSparer)
	if !ok || rec.Container == nil {
		return nil
	}
	if err := s.SpareAgentSession(ctx, rec.Container.ID); err != nil {
		return fmt.Errorf("spare agent session: %w", err)
	}
	return nil
}

// needsQuiesce says whether rec's runtime saves memory and needs the agent
// quiet for it.
func (n *Node) needsQuiesce(rec *sandbox.Record) bool {
	d, err := n.Driver(rec.Runtime)
	if err != nil {
		return false
	}
	_, ok := agentclient.NeedsQuiesce(d, rec)
	return ok
}

// reinitAgent re-initialises what must differ in a clone restored from
// another sandbox's memory image (agentclient.Reinit): hostname, the
// variables the container spec sets, clock, entropy, a VM's MAC.
func (n *Node) reinitAgent(ctx context.Context, t *Task) error {
	rec := t.Record()
	d, err := n.Driver(rec.Runtime)
	if err != nil {
		return err
	}
	spec := specOf(rec, rec.Container, t.Template)
	// A VM's agent starts with the kernel's bare environment, so it gets
	// all of it, PATH included; a container's has it from its spec.
	return agentclient.Reinit(ctx, d, rec, heldToken(d, t), spec.Hostname, spec.Env, d.Capabilities().BootsDisk)
}

// startService starts the template's service (sandbox.Template.StartCmd)
// in a sandbox that booted cold, and waits until its ready command
// succeeds, within the agent's wait budget. A sandbox restored from a
// memory image has it running already.
func (n *Node) startService(ctx context.Context, t *Task) error {
	if t.Template == nil || t.Template.StartCmd == "" {
		return nil
	}
	rec := t.Record()
	d, err := n.Driver(rec.Runtime)
	if err != nil {
		return err
	}
	if memoryImage(d, t) != "" {
		return nil
	}
	ctx, cancel := n.agentWait(ctx, rec)
	defer cancel()
	start := time.Now()
	if err := withWaitCause(ctx, agentclient.StartService(ctx, d, rec, t.Template.StartCmd, t.Template.ReadyCmd)); err != nil {
		return err
	}
	slog.DebugContext(ctx, "template service ready", "sandbox_id", rec.ID, "template", t.Template.ID, "took", time.Since(start))
	return nil
}

// sealConsole switches a VM's console away from its file once the agent
// answered (runtime.ConsoleSealer). A failure is logged, not fatal: the
// sandbox works either way.
func (n *Node) sealConsole(ctx context.Context, rec *sandbox.Record) {
	d, err := n.Driver(rec.Runtime)
	if err != nil {
		return
	}
	if c, ok := d.(runtime.ConsoleSealer); ok {
		if err := c.SealConsole(ctx, rec.Container.ID); err != nil {
			slog.WarnContext(ctx, "seal VM console", "sandbox_id", rec.ID, "error", err)
		}
	}
}

// withConsole adds the tail of a VM's serial console
// (runtime.ConsoleLogger) to an agent error: a guest that never reached
// its agent says why there (kernel panic, missing module, init failure),
// and the bundle holding it is removed by the undo that follows.
func (n *Node) withConsole(rec *sandbox.Record, err error) error {
	d, derr := n.Driver(rec.Runtime)
	if derr != nil {
		return err
	}
	c, ok := d.(runtime.ConsoleLogger)
	if !ok {
		return err
	}
	path, cerr := c.ConsoleLog(rec.Container.ID)
	if cerr != nil {
		return err
	}
	b, _ := os.ReadFile(path)
	if len(b) > 2048 {
		b = b[len(b)-2048:]
	}
	if len(b) == 0 {
		return err
	}
	return fmt.Errorf("%w; guest console ends with:\n%s", err, b)
}
