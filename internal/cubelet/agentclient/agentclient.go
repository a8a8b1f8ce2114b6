// Package agentclient is how cubelet talks to the cube-agent inside a
// sandbox over HTTP: it picks the endpoint (the runtime's own channel,
// the network slot's host IP, or the sandbox's network namespace), polls
// /health, and quiesces, wakes and re-initialises the agent. Every request
// carries the sandbox's access token (sandbox.Record.AccessToken): a
// sandbox created with one has an agent that answers nothing without it.
package agentclient

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
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/nsdial"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// Endpoint is how cubelet reaches one sandbox's cube-agent: an HTTP
// client and the base URL requests go to. Callers close idle connections
// when done (a VM's channel takes one client at a time).
type Endpoint struct {
	Client *http.Client
	Base   string // "http://host:port", no trailing slash
	PID    int    // the sandbox's init on the host, watched while polling
	// Token goes in X-Access-Token on every request ("" = none).
	Token string
}

// URL is path on the agent.
func (e Endpoint) URL(path string) string { return e.Base + path }

// NewRequest is a request to path on the agent, with the access token.
func (e Endpoint) NewRequest(ctx context.Context, method, path string, body io.Reader) (*http.Request, error) {
	req, err := http.NewRequestWithContext(ctx, method, e.URL(path), body)
	if err != nil {
		return nil, err
	}
	if e.Token != "" {
		req.Header.Set(agentproto.AccessTokenHeader, e.Token)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	return req, nil
}

// EndpointFor picks the path to a sandbox's agent, most direct first: the
// runtime's own channel (runtime.AgentChannel: VMs), the slot's host IP
// (what the proxy uses: with a slot, a sandbox is Running only when
// reachable that way), or the sandbox's network namespace (runc without
// network-agent).
func EndpointFor(d runtime.Driver, rec *sandbox.Record) (Endpoint, error) {
	if rec.Container == nil || rec.Container.PID == 0 {
		return Endpoint{}, fmt.Errorf("agent: sandbox has no running container: %w", errdefs.ErrFailedPrecondition)
	}
	pid := rec.Container.PID
	if ch, ok := d.(runtime.AgentChannel); ok {
		c, err := ch.AgentClient(rec.Container.ID)
		if err != nil {
			return Endpoint{}, err
		}
		// The host is a placeholder: the channel's transport ignores it.
		return Endpoint{Client: c, Base: "http://agent", PID: pid, Token: rec.AccessToken}, nil
	}
	if nw := rec.Network; nw != nil && nw.HostIP != "" {
		return Endpoint{Client: hostIPClient(), Base: "http://" + net.JoinHostPort(nw.HostIP, strconv.Itoa(agentproto.Port)), PID: pid, Token: rec.AccessToken}, nil
	}
	return Endpoint{
		Client: nsdial.HTTPClient(fmt.Sprintf("/proc/%d/ns/net", pid)),
		Base:   fmt.Sprintf("http://127.0.0.1:%d", agentproto.Port),
		PID:    pid,
		Token:  rec.AccessToken,
	}, nil
}

func hostIPClient() *http.Client {
	return &http.Client{Transport: &http.Transport{
		Proxy:       nil,
		DialContext: (&net.Dialer{Timeout: time.Second}).DialContext,
	}}
}

// resetClient is hostIPClient whose connections close with a reset
// (SO_LINGER 0) instead of a FIN.
func resetClient() *http.Client {
	d := &net.Dialer{Timeout: time.Second}
	return &http.Client{Transport: &http.Transport{
		Proxy: nil,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := d.DialContext(ctx, network, addr)
			if tc, ok := c.(*net.TCPConn); ok {
				_ = tc.SetLinger(0)
			}
			return c, err
		},
	}}
}

// Wait polls the sandbox's agent /health until it answers.
func Wait(ctx context.Context, d runtime.Driver, rec *sandbox.Record) error {
	e, err := EndpointFor(d, rec)
	if err != nil {
		return err
	}
	return pollHealth(ctx, e)
}

// WaitAgent polls the agent's /health in the network namespace of pid
// until it answers, the process dies, or ctx ends.
func WaitAgent(ctx context.Context, pid int) error {
	return pollHealth(ctx, Endpoint{
		Client: nsdial.HTTPClient(fmt.Sprintf("/proc/%d/ns/net", pid)),
		Base:   fmt.Sprintf("http://127.0.0.1:%d", agentproto.Port), PID: pid,
	})
}

// WaitAgentVia polls the agent's /health through the sandbox's host IP
// (its slot DNATs every port there to the sandbox) until it answers, the
// sandbox's init (pid) dies, or ctx ends. This is the path the proxy
// uses, so a sandbox is Running only when it is reachable that way.
func WaitAgentVia(ctx context.Context, pid int, hostIP string) error {
	return pollHealth(ctx, Endpoint{
		Client: hostIPClient(), Base: "http://" + net.JoinHostPort(hostIP, strconv.Itoa(agentproto.Port)), PID: pid,
	})
}

// pollHealth GETs /health with a doubling delay (1 ms to 20 ms) until it
// answers 2xx, the sandbox's init (e.PID) dies, or ctx ends. Every way of
// reaching the agent uses it.
func pollHealth(ctx context.Context, e Endpoint) error {
	client, url, pid := e.Client, e.URL("/health"), e.PID
	defer client.CloseIdleConnections()
	delay := time.Millisecond
	var last error
	for {
		req, _ := e.NewRequest(ctx, http.MethodGet, "/health", nil)
		resp, err := client.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode/100 == 2 {
				return nil
			}
			err = fmt.Errorf("health answered %s", resp.Status)
		}
		last = err
		if _, serr := os.Stat(fmt.Sprintf("/proc/%d", pid)); errors.Is(serr, os.ErrNotExist) {
			return fmt.Errorf("agent: sandbox init (pid %d) exited before answering: %w", pid, errdefs.ErrUnavailable)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("agent not ready at %s: %v (last: %v): %w", url, ctx.Err(), last, errdefs.ErrUnavailable)
		case <-time.After(delay):
		}
		if delay < 20*time.Millisecond {
			delay *= 2
		}
	}
}

// QuiesceTimeout is how long a quiesced agent waits for its wake-up before
// it listens again by itself; longer than any checkpoint plus disk copy.
const QuiesceTimeout = 5 * time.Minute

// NeedsQuiesce says whether rec's runtime saves memory and needs the agent
// quiet for it (runtime.AgentWaker: gVisor's runsc cannot save a TCP
// socket), and returns the waker.
func NeedsQuiesce(d runtime.Driver, rec *sandbox.Record) (runtime.AgentWaker, bool) {
	if d == nil || !d.Capabilities().Checkpoint || rec.Container == nil {
		return nil, false
	}
	w, ok := d.(runtime.AgentWaker)
	return w, ok
}

// Quiesce asks the sandbox's agent to close every TCP socket it holds
// (agent/quiesce.go). The agent refuses, changing nothing, when other TCP
// sockets are open in the sandbox: runsc would fail on them and take the
// sandbox down, so the snapshot is refused with FailedPrecondition naming
// them. cubelet closes its connection first once the answer is read, so
// the endpoint inside the sandbox closes passively (no TIME_WAIT).
func Quiesce(ctx context.Context, d runtime.Driver, rec *sandbox.Record) error {
	e, err := EndpointFor(d, rec)
	if err != nil {
		return err
	}
	if _, channel := d.(runtime.AgentChannel); !channel && rec.Network != nil && rec.Network.HostIP != "" {
		// Closed with a reset once the answer is read: the endpoint in
		// the sandbox is then gone at once, not in LAST_ACK until the
		// sandbox has taken our ACK of its FIN, which runsc cannot save.
		e.Client = resetClient()
	}
	defer e.Client.CloseIdleConnections()
	body, _ := json.Marshal(agentproto.QuiesceRequest{TimeoutMs: QuiesceTimeout.Milliseconds()})
	req, err := e.NewRequest(ctx, http.MethodPost, agentproto.PathQuiesce, bytes.NewReader(body))
	if err != nil {
		return err
	}
	resp, err := e.Client.Do(req)
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
		e.Client.CloseIdleConnections()
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
			// A reset, not a FIN: this probe must leave no endpoint
			// in the sandbox (see resetClient).
			if tc, ok := c.(*net.TCPConn); ok {
				_ = tc.SetLinger(0)
			}
			c.Close()
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("quiesced agent of %s still listens: %w", rec.ID, errdefs.ErrUnavailable)
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// Wake wakes a quiesced agent and waits (at most timeout) until it
// answers /health, waking it again every second in case a signal went
// astray. Where the runtime needs no quiesce it only waits for /health.
func Wake(ctx context.Context, d runtime.Driver, rec *sandbox.Record, timeout time.Duration) error {
	w, ok := NeedsQuiesce(d, rec)
	if !ok {
		return Wait(ctx, d, rec)
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	const wakeEvery = time.Second
	for {
		if err := w.WakeAgent(ctx, rec.Container.ID); err != nil {
			return fmt.Errorf("wake agent: %w", err)
		}
		try, stop := context.WithTimeout(ctx, wakeEvery)
		err := Wait(try, d, rec)
		stop()
		if err == nil || ctx.Err() != nil || try.Err() == nil {
			return err
		}
	}
}

// Reinit re-initialises what must differ in a clone restored from another
// sandbox's memory image: hostname, the variables of env ("K=V", what the
// container spec sets: CUBE_SANDBOX_ID, ...), clock and entropy, a VM's
// MAC (runtime.MACReporter), and the access token, which becomes rec's.
// held is the token the agent holds now, which the request carries: the
// snapshot's for a clone restored from memory, rec's own otherwise.
// fullEnv sends PATH too (a VM's agent starts with the kernel's bare
// environment). The response says what the sandbox permitted; skipped
// items are logged, not failures (gVisor keeps the host clock and may
// refuse the hostname).
func Reinit(ctx context.Context, d runtime.Driver, rec *sandbox.Record, held, hostname string, envList []string, fullEnv bool) error {
	e, err := EndpointFor(d, rec)
	if err != nil {
		return err
	}
	e.Token = held
	defer e.Client.CloseIdleConnections()
	env := map[string]string{}
	for _, kv := range envList {
		if k, v, ok := strings.Cut(kv, "="); ok && (k != "PATH" || fullEnv) {
			env[k] = v
		}
	}
	seed := make([]byte, 64)
	_, _ = rand.Read(seed)
	token := rec.AccessToken
	ri := agentproto.ReinitRequest{
		Hostname: hostname, Env: env, TimeUnixNs: time.Now().UnixNano(),
		Entropy: base64.StdEncoding.EncodeToString(seed), AccessToken: &token,
	}
	// A VM clone's NIC still has the original's address in guest memory.
	if m, ok := d.(runtime.MACReporter); ok && rec.Network != nil {
		ri.MAC = m.MAC(rec.Container.ID)
	}
	body, _ := json.Marshal(ri) //nolint:gosec // G117: the token goes to the sandbox's own agent, whose token it becomes
	req, err := e.NewRequest(ctx, http.MethodPost, agentproto.PathReinit, bytes.NewReader(body))
	if err != nil {
		return err
	}
	resp, err := e.Client.Do(req)
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

// Prepare asks the sandbox's agent to build now what a user's first call
// would otherwise build (agentproto.PathPrepare): cubelet calls it on a
// warm-pool entry before freezing it, so a claim does not pay for it. An
// agent that predates the endpoint (404) has nothing to prepare.
func Prepare(ctx context.Context, d runtime.Driver, rec *sandbox.Record) error {
	e, err := EndpointFor(d, rec)
	if err != nil {
		return err
	}
	defer e.Client.CloseIdleConnections()
	req, err := e.NewRequest(ctx, http.MethodPost, agentproto.PathPrepare, nil)
	if err != nil {
		return err
	}
	resp, err := e.Client.Do(req)
	if err != nil {
		return fmt.Errorf("prepare agent: %w: %w", err, errdefs.ErrUnavailable)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	switch resp.StatusCode {
	case http.StatusNoContent, http.StatusOK, http.StatusNotFound:
		return nil
	default:
		return fmt.Errorf("prepare agent: %s: %s: %w", resp.Status, strings.TrimSpace(string(b)), errdefs.ErrUnavailable)
	}
}
