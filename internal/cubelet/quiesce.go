package cubelet

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// agentWaker is a driver whose memory checkpoint needs the agent quiesced
// first (no TCP socket in the sandbox: gVisor's runsc cannot save one) and
// that can wake it after the restore (gvisor: SIGUSR2 to PID 1).
type agentWaker interface {
	WakeAgent(ctx context.Context, id string) error
}

// quiesceTimeout is how long a quiesced agent waits for its wake-up before
// it listens again by itself; longer than any checkpoint plus disk copy.
const quiesceTimeout = 5 * time.Minute

// needsQuiesce says whether rec's runtime saves memory and needs the agent
// quiet for it.
func (n *node) needsQuiesce(rec *sandbox.Record) (agentWaker, bool) {
	d, err := n.driver(rec.Runtime)
	if err != nil || !d.Capabilities().Checkpoint || rec.Container == nil {
		return nil, false
	}
	w, ok := d.(agentWaker)
	return w, ok
}

// quiesceAgent asks the sandbox's agent to close every TCP socket it holds
// (agent/quiesce.go). The agent refuses, changing nothing, when other TCP
// sockets are open in the sandbox: runsc would fail on them and take the
// sandbox down, so the snapshot is refused with FailedPrecondition naming
// them. cubelet closes its connection first once the answer is read, so
// the endpoint inside the sandbox closes passively (no TIME_WAIT).
func (n *node) quiesceAgent(ctx context.Context, rec *sandbox.Record) error {
	e, err := n.agentEndpointFor(rec)
	if err != nil {
		return err
	}
	defer e.client.CloseIdleConnections()
	body, _ := json.Marshal(agentproto.QuiesceRequest{TimeoutMs: quiesceTimeout.Milliseconds()})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.url(agentproto.PathQuiesce), bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := e.client.Do(req)
	if err != nil {
		return fmt.Errorf("quiesce agent: %w: %w", err, errdefs.ErrUnavailable)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	var res agentproto.QuiesceResponse
	_ = json.Unmarshal(b, &res)
	switch {
	case resp.StatusCode == http.StatusOK && res.Quiesced:
		// The agent closes its listener once it sees this connection
		// closed; runsc must not save before that.
		resp.Body.Close()
		e.client.CloseIdleConnections()
		return waitListenerClosed(ctx, rec)
	case resp.StatusCode == http.StatusConflict:
		return fmt.Errorf("memory snapshot of %s refused: %s (%s cannot save open TCP sockets; close them or snapshot without memory): %w",
			rec.ID, res.Error, rec.Runtime, errdefs.ErrFailedPrecondition)
	default:
		return fmt.Errorf("quiesce agent: %s: %s: %w", resp.Status, strings.TrimSpace(string(b)), errdefs.ErrUnavailable)
	}
}

// waitListenerClosed dials the agent's port (the slot address, where a
// quiesce is used) until the sandbox refuses the connection: the agent has
// closed its listener and no endpoint waits on it any more.
func waitListenerClosed(ctx context.Context, rec *sandbox.Record) error {
	if rec.Network == nil || rec.Network.HostIP == "" {
		return nil
	}
	addr := net.JoinHostPort(rec.Network.HostIP, strconv.Itoa(agentproto.Port))
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	var d net.Dialer
	for {
		c, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			if errors.Is(err, syscall.ECONNREFUSED) {
				return nil
			}
			if ctx.Err() != nil {
				return fmt.Errorf("quiesced agent of %s still listens: %w", rec.ID, errdefs.ErrUnavailable)
			}
		} else {
			c.Close()
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("quiesced agent of %s still listens: %w", rec.ID, errdefs.ErrUnavailable)
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// wakeAgent wakes a quiesced agent and waits until it answers /health,
// waking it again every wakeEvery in case a signal went astray.
func (n *node) wakeAgent(ctx context.Context, rec *sandbox.Record) error {
	w, ok := n.needsQuiesce(rec)
	if !ok {
		return n.waitAgent(ctx, rec)
	}
	ctx, cancel := context.WithTimeout(ctx, n.cfg.Sandbox.AgentReadyTimeout.Duration)
	defer cancel()
	const wakeEvery = time.Second
	for {
		if err := w.WakeAgent(ctx, rec.Container.ID); err != nil {
			return fmt.Errorf("wake agent: %w", err)
		}
		try, stop := context.WithTimeout(ctx, wakeEvery)
		err := n.waitAgent(try, rec)
		stop()
		if err == nil || ctx.Err() != nil || try.Err() == nil {
			return err
		}
	}
}

// quiesceAction quiets the agent before the memory action checkpoints,
// while the sandbox still runs (a paused sandbox is thawed for it and
// frozen again): first in [flows.snapshot].
type quiesceAction struct{ n *node }

func (*quiesceAction) Name() string { return "quiesce" }

func (a *quiesceAction) Snapshot(ctx context.Context, t *Task) error {
	o, err := op(t)
	if err != nil {
		return err
	}
	rec := t.Record()
	if _, ok := a.n.needsQuiesce(rec); !ok {
		return nil
	}
	d, _ := a.n.driver(rec.Runtime)
	if o.prev == lifecycle.Paused {
		if err := settle(ctx, d, rec.Container.ID, runtime.StatusRunning, d.Resume(ctx, rec.Container.ID)); err != nil {
			return err
		}
		o.thawedForQuiesce = true
	}
	// Set first: a quiesce whose answer was lost after the agent acted
	// must still be woken by the undo. A 409 means it changed nothing.
	o.quiesced = true
	if err := a.n.quiesceAgent(ctx, rec); err != nil {
		if errdefs.IsFailedPrecondition(err) {
			o.quiesced = false
		}
		return errors.Join(err, a.refreeze(ctx, d, o, rec))
	}
	return a.refreeze(ctx, d, o, rec)
}

func (a *quiesceAction) refreeze(ctx context.Context, d runtime.Driver, o *snapOp, rec *sandbox.Record) error {
	if !o.thawedForQuiesce {
		return nil
	}
	if err := settle(ctx, d, rec.Container.ID, runtime.StatusPaused, d.Pause(ctx, rec.Container.ID)); err != nil {
		return err
	}
	o.thawedForQuiesce = false
	return nil
}

// UndoSnapshot wakes an agent still quiesced (no checkpoint stopped the
// sandbox, or its restore already woke it and cleared the flag).
func (a *quiesceAction) UndoSnapshot(ctx context.Context, t *Task) error {
	o, err := op(t)
	if err != nil || !o.quiesced {
		return err
	}
	return wakeQuiesced(ctx, a.n, t, o)
}

// wakeQuiesced wakes the agent the quiesce action quieted, leaving the
// sandbox paused again if it was.
func wakeQuiesced(ctx context.Context, n *node, t *Task, o *snapOp) error {
	rec := t.Record()
	d, err := n.driver(rec.Runtime)
	if err != nil {
		return err
	}
	st, err := d.State(ctx, rec.Container.ID)
	if err != nil {
		return err
	}
	if st.Status == runtime.StatusPaused {
		if err := d.Resume(ctx, rec.Container.ID); err != nil {
			return err
		}
	}
	if err := n.wakeAgent(ctx, rec); err != nil {
		return err
	}
	o.quiesced = false
	if st.Status == runtime.StatusPaused {
		return d.Pause(ctx, rec.Container.ID)
	}
	return nil
}

// reinitAgent re-initialises what must differ in a clone restored from
// another sandbox's memory image: hostname, the variables the container
// spec sets (CUBE_SANDBOX_ID, ...), clock and entropy. The response says
// what the sandbox permitted; skipped items are logged, not failures
// (gVisor keeps the host clock and may refuse the hostname).
func (n *node) reinitAgent(ctx context.Context, t *Task) error {
	rec := t.Record()
	e, err := n.agentEndpointFor(rec)
	if err != nil {
		return err
	}
	defer e.client.CloseIdleConnections()
	spec := (&containerAction{n: n}).spec(rec, rec.Container, t.Template)
	// A VM's agent starts with the kernel's bare environment, so it gets
	// all of it, PATH included; a container's has it from its spec.
	boots := n.bootsDisk(rec.Runtime)
	env := map[string]string{}
	for _, kv := range spec.Env {
		if k, v, ok := strings.Cut(kv, "="); ok && (k != "PATH" || boots) {
			env[k] = v
		}
	}
	seed := make([]byte, 64)
	_, _ = rand.Read(seed)
	ri := agentproto.ReinitRequest{
		Hostname: spec.Hostname, Env: env, TimeUnixNs: time.Now().UnixNano(),
		Entropy: base64.StdEncoding.EncodeToString(seed),
	}
	// A VM clone's NIC still has the original's address in guest memory.
	if d, err := n.driver(rec.Runtime); err == nil && rec.Network != nil {
		if m, ok := d.(interface{ MAC(id string) string }); ok {
			ri.MAC = m.MAC(rec.Container.ID)
		}
	}
	body, _ := json.Marshal(ri)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.url(agentproto.PathReinit), bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := e.client.Do(req)
	if err != nil {
		return fmt.Errorf("reinit agent: %w: %w", err, errdefs.ErrUnavailable)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("reinit agent: %s: %s: %w", resp.Status, strings.TrimSpace(string(b)), errdefs.ErrUnavailable)
	}
	var res agentproto.ReinitResponse
	_ = json.Unmarshal(b, &res)
	slog.DebugContext(ctx, "agent re-initialised", "sandbox_id", rec.ID, "applied", res.Applied, "skipped", res.Skipped)
	return nil
}

// Clone waits for the clone's agent and, when the clone was restored from
// memory (it then holds the original's identity), re-initialises it.
func (a *agentAction) Clone(ctx context.Context, t *Task) error {
	d, err := a.n.driver(t.Record().Runtime)
	if err != nil {
		return err
	}
	if _, ok := d.(agentWaker); ok && memoryImage(d, t) != "" {
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
		return nil
	}
	return a.n.reinitAgent(ctx, t)
}
