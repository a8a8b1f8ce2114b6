package sandbox

import (
	"context"
	"encoding/base64"
	"maps"
	"net/http"
	"strconv"
	"time"

	"connectrpc.com/connect"

	"github.com/cubesandbox/cube/api/envd/filesystem/filesystemconnect"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
)

// Sandbox is a running sandbox: its identity, and the agent's services
// (Commands, Pty, Files) reached through the sandbox route with its access
// token. Get one from Client.Create, Client.Connect, Client.Resume or
// Client.Fork.
type Sandbox struct {
	ID         string
	TemplateID string
	// EnvdVersion is the version of the agent's envd API.
	EnvdVersion string
	// EnvdAccessToken authenticates calls to the agent; set on every
	// sandbox the API creates (secure sandboxes). Calls read it when they
	// start: change it only while no call is in flight.
	EnvdAccessToken string
	// TrafficAccessToken, when set, must come with requests to the
	// sandbox's other ports (E2b-Traffic-Access-Token).
	TrafficAccessToken string
	// Domain is the sandbox's domain as the API reports it (may be empty).
	Domain string
	// Runtime is CubeSandbox's extension: the runtime it runs on.
	Runtime string

	Commands *Commands
	Pty      *Pty
	Files    *Files

	client *Client
	// envd is the agent's base URL and http the client that reaches it,
	// adding the sandbox's headers.
	envd string
	http *http.Client
}

func (s *Sandbox) init() {
	base, named := s.client.cfg.sandboxBase(s.ID, s.Domain, EnvdPort)
	h := http.Header{}
	if named {
		h.Set("E2b-Sandbox-Id", s.ID)
		h.Set("E2b-Sandbox-Port", strconv.Itoa(EnvdPort))
	}
	hc := *s.client.cfg.HTTPClient
	rt := hc.Transport
	if rt == nil {
		rt = http.DefaultTransport
	}
	hc.Transport = headerTransport{base: rt, headers: h, s: s}
	s.envd, s.http = base, &hc
	proc := processconnect.NewProcessClient(&hc, base)
	s.Commands = &Commands{s: s, rpc: proc}
	s.Pty = &Pty{s: s, rpc: proc}
	s.Files = &Files{s: s, rpc: filesystemconnect.NewFilesystemClient(&hc, base)}
}

// headerTransport adds the sandbox's headers and access token to every
// request.
type headerTransport struct {
	base    http.RoundTripper
	headers http.Header
	s       *Sandbox
}

func (t headerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	maps.Copy(r.Header, t.headers)
	if tok := t.s.EnvdAccessToken; tok != "" {
		r.Header.Set("X-Access-Token", tok)
	}
	return t.base.RoundTrip(r)
}

// userHeader names the Linux user a call runs as (the agent's default
// user when empty), as envd reads it: Basic auth with an empty password.
func userHeader(h http.Header, user string) {
	if user != "" {
		h.Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte(user+":")))
	}
}

// request returns a Connect request for msg as user.
func request[T any](msg *T, user string) *connect.Request[T] {
	r := connect.NewRequest(msg)
	userHeader(r.Header(), user)
	return r
}

// keepaliveHeader asks the agent for keepalive events on quiet streams,
// every 50 s as E2B's SDKs do, so idle proxies never cut them.
func keepalive(h http.Header) { h.Set("Keepalive-Ping-Interval", "50") }

// Host is the address of port on the sandbox under its domain
// (<port>-<id>.<domain>), for clients that reach sandbox ports by name.
func (s *Sandbox) Host(port int) string {
	d := s.Domain
	if d == "" {
		d = s.client.cfg.Domain
	}
	return strconv.Itoa(port) + "-" + s.ID + "." + d
}

// Kill ends the sandbox.
func (s *Sandbox) Kill(ctx context.Context) error { return s.client.Kill(ctx, s.ID) }

// Pause pauses the sandbox; Resume or Connect bring it back.
func (s *Sandbox) Pause(ctx context.Context) error { return s.client.Pause(ctx, s.ID) }

// Resume resumes the paused sandbox with timeout to live.
func (s *Sandbox) Resume(ctx context.Context, timeout time.Duration) error {
	_, err := s.client.Resume(ctx, s.ID, timeout)
	return err
}

// Connect resumes the sandbox if it is paused and sets its time to live.
func (s *Sandbox) Connect(ctx context.Context, timeout time.Duration) error {
	_, err := s.client.Connect(ctx, s.ID, timeout)
	return err
}

// SetTimeout sets the sandbox's time to live to timeout from now.
func (s *Sandbox) SetTimeout(ctx context.Context, timeout time.Duration) error {
	return s.client.SetTimeout(ctx, s.ID, timeout)
}

// GetInfo describes the sandbox.
func (s *Sandbox) GetInfo(ctx context.Context) (*Info, error) { return s.client.GetInfo(ctx, s.ID) }

// IsRunning reports whether the agent answers its health check.
func (s *Sandbox) IsRunning(ctx context.Context) (bool, error) {
	ctx, cancel := s.client.unaryContext(ctx)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.envd+"/health", nil)
	if err != nil {
		return false, err
	}
	resp, err := s.http.Do(req)
	if err != nil {
		return false, classify("health of sandbox "+s.ID, err)
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusNoContent || resp.StatusCode == http.StatusOK, nil
}

// CreateSnapshot snapshots the sandbox (it keeps running); create
// sandboxes from it with CreateOptions.Template = SnapshotID.
func (s *Sandbox) CreateSnapshot(ctx context.Context, name string) (*SnapshotInfo, error) {
	return s.client.CreateSnapshot(ctx, s.ID, name)
}

// Fork makes count copies of the sandbox (see Client.Fork).
func (s *Sandbox) Fork(ctx context.Context, count int, timeout time.Duration) ([]ForkResult, error) {
	return s.client.Fork(ctx, s.ID, count, timeout)
}
