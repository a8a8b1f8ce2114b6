package sandbox

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Client calls the E2B REST API. It is safe for concurrent use.
type Client struct {
	cfg Config
}

// NewClient returns a client for cfg, completed from the environment
// (see Config). It fails only when no API key is configured.
func NewClient(cfg Config) (*Client, error) {
	c, err := cfg.resolved()
	if err != nil {
		return nil, err
	}
	return &Client{cfg: c}, nil
}

// Config returns the client's configuration with its defaults filled in.
func (c *Client) Config() Config { return c.cfg }

// unaryContext bounds a unary call by the request timeout unless ctx has
// an earlier deadline.
func (c *Client) unaryContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if c.cfg.RequestTimeout < 0 {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, c.cfg.RequestTimeout)
}

// do sends one API request with body (JSON, unless nil) and decodes a 2xx
// answer into out (unless nil). It returns the response headers.
func (c *Client) do(ctx context.Context, op, method, path string, query url.Values, body, out any) (http.Header, error) {
	ctx, cancel := c.unaryContext(ctx)
	defer cancel()
	u := c.cfg.APIURL + path
	if len(query) > 0 {
		u += "?" + query.Encode()
	}
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", op, err)
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, u, rd)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	maps.Copy(req.Header, c.cfg.Headers)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("X-API-Key", c.cfg.APIKey)
	req.Header.Set("User-Agent", "cube-sdk-go")
	resp, err := c.cfg.HTTPClient.Do(req)
	if err != nil {
		return nil, classify(op, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, classify(op, err)
	}
	if resp.StatusCode/100 != 2 {
		return nil, fmt.Errorf("%s: %w", op, apiError(resp, data))
	}
	if out != nil && len(data) > 0 {
		if err := json.Unmarshal(data, out); err != nil {
			return nil, fmt.Errorf("%s: decoding the answer: %w", op, err)
		}
	}
	return resp.Header, nil
}

func apiError(resp *http.Response, data []byte) *APIError {
	e := &APIError{StatusCode: resp.StatusCode}
	var body struct {
		Message   string `json:"message"`
		ErrorCode string `json:"error_code"`
	}
	if json.Unmarshal(data, &body) == nil && body.Message != "" {
		e.Message, e.ErrorCode = body.Message, body.ErrorCode
	} else {
		e.Message = strings.TrimSpace(string(data))
		if e.Message == "" {
			e.Message = http.StatusText(resp.StatusCode)
		}
	}
	if s, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil && s > 0 {
		e.RetryAfter = time.Duration(s) * time.Second
	}
	return e
}

// seconds is a duration in whole seconds, rounded up (E2B's timeouts).
func seconds(d time.Duration) int64 {
	return int64((d + time.Second - 1) / time.Second)
}

// DefaultTemplate is the template a create without one asks for.
const DefaultTemplate = "base"

// DefaultSandboxTimeout is a sandbox's time to live when CreateOptions
// names none, as in E2B's SDKs.
const DefaultSandboxTimeout = 5 * time.Minute

// CreateOptions describe a new sandbox. The zero value is the default
// template for DefaultSandboxTimeout.
type CreateOptions struct {
	// Template is a template's ID or alias, or a snapshot's ID (the
	// sandbox starts from the snapshot); default DefaultTemplate.
	Template string
	// Timeout is how long the sandbox lives before it is killed (or
	// paused, with AutoPause); default DefaultSandboxTimeout.
	Timeout time.Duration
	// Metadata is kept with the sandbox and filters List.
	Metadata map[string]string
	// Envs are set for every command the sandbox runs.
	Envs map[string]string
	// AllowInternetAccess, when set, turns the sandbox's outbound
	// internet access on or off.
	AllowInternetAccess *bool
	// AutoPause pauses the sandbox at its timeout instead of killing it.
	AutoPause bool
	// AutoResume resumes an auto-paused sandbox when traffic reaches it
	// (needs AutoPause).
	AutoResume bool
	// Runtime is CubeSandbox's extension: the runtime to run on (runc,
	// gvisor, vm); empty: the template's, else the node's default.
	Runtime string
}

// sandboxJSON is the API's Sandbox (create, connect, resume).
type sandboxJSON struct {
	SandboxID          string  `json:"sandboxID"`
	TemplateID         string  `json:"templateID"`
	Alias              string  `json:"alias"`
	EnvdVersion        string  `json:"envdVersion"`
	EnvdAccessToken    string  `json:"envdAccessToken"`
	TrafficAccessToken *string `json:"trafficAccessToken"`
	Domain             *string `json:"domain"`
	Runtime            string  `json:"runtime"`
}

func (c *Client) sandbox(j *sandboxJSON) *Sandbox {
	s := &Sandbox{
		ID: j.SandboxID, TemplateID: j.TemplateID, EnvdVersion: j.EnvdVersion,
		EnvdAccessToken: j.EnvdAccessToken, Runtime: j.Runtime, client: c,
	}
	if j.TrafficAccessToken != nil {
		s.TrafficAccessToken = *j.TrafficAccessToken
	}
	if j.Domain != nil {
		s.Domain = *j.Domain
	}
	s.init()
	return s
}

// Create starts a sandbox and returns it once its agent serves.
func (c *Client) Create(ctx context.Context, opts CreateOptions) (*Sandbox, error) {
	if opts.Template == "" {
		opts.Template = DefaultTemplate
	}
	if opts.Timeout == 0 {
		opts.Timeout = DefaultSandboxTimeout
	}
	if opts.AutoResume && !opts.AutoPause {
		return nil, fmt.Errorf("create: AutoResume needs AutoPause: %w", ErrInvalidArgument)
	}
	body := map[string]any{
		"templateID": opts.Template,
		"timeout":    seconds(opts.Timeout),
		"secure":     true,
	}
	if opts.Metadata != nil {
		body["metadata"] = opts.Metadata
	}
	if opts.Envs != nil {
		body["envVars"] = opts.Envs
	}
	if opts.AllowInternetAccess != nil {
		body["allow_internet_access"] = *opts.AllowInternetAccess
	}
	if opts.AutoPause {
		body["autoPause"] = true
	}
	if opts.AutoResume {
		body["autoResume"] = map[string]bool{"enabled": true}
	}
	if opts.Runtime != "" {
		body["runtime"] = opts.Runtime
	}
	var out sandboxJSON
	if _, err := c.do(ctx, "create sandbox", http.MethodPost, "/v2/sandboxes", nil, body, &out); err != nil {
		return nil, err
	}
	return c.sandbox(&out), nil
}

// Connect returns a running sandbox, resuming it first when it is paused,
// and sets its time to live to timeout from now (zero: the service's
// default).
func (c *Client) Connect(ctx context.Context, sandboxID string, timeout time.Duration) (*Sandbox, error) {
	body := map[string]any{}
	if timeout > 0 {
		body["timeout"] = seconds(timeout)
	}
	var out sandboxJSON
	if _, err := c.do(ctx, "connect to sandbox "+sandboxID, http.MethodPost, "/v2/sandboxes/"+url.PathEscape(sandboxID)+"/connect", nil, body, &out); err != nil {
		return nil, err
	}
	return c.sandbox(&out), nil
}

// Resume resumes a paused sandbox with timeout to live (zero: the
// service's default). A running sandbox is ErrConflict; Connect resumes
// only when needed.
func (c *Client) Resume(ctx context.Context, sandboxID string, timeout time.Duration) (*Sandbox, error) {
	body := map[string]any{}
	if timeout > 0 {
		body["timeout"] = seconds(timeout)
	}
	var out sandboxJSON
	if _, err := c.do(ctx, "resume sandbox "+sandboxID, http.MethodPost, "/sandboxes/"+url.PathEscape(sandboxID)+"/resume", nil, body, &out); err != nil {
		return nil, err
	}
	return c.sandbox(&out), nil
}

// Kill ends a sandbox. An unknown sandbox is ErrNotFound.
func (c *Client) Kill(ctx context.Context, sandboxID string) error {
	_, err := c.do(ctx, "kill sandbox "+sandboxID, http.MethodDelete, "/sandboxes/"+url.PathEscape(sandboxID), nil, nil, nil)
	return err
}

// Pause pauses a running sandbox (its memory and disk are kept; Connect
// or Resume brings it back). A paused one is ErrConflict.
func (c *Client) Pause(ctx context.Context, sandboxID string) error {
	_, err := c.do(ctx, "pause sandbox "+sandboxID, http.MethodPost, "/sandboxes/"+url.PathEscape(sandboxID)+"/pause", nil, map[string]any{}, nil)
	return err
}

// SetTimeout sets a sandbox's time to live to timeout from now.
func (c *Client) SetTimeout(ctx context.Context, sandboxID string, timeout time.Duration) error {
	_, err := c.do(ctx, "set timeout of sandbox "+sandboxID, http.MethodPost, "/sandboxes/"+url.PathEscape(sandboxID)+"/timeout", nil,
		map[string]any{"timeout": seconds(timeout)}, nil)
	return err
}

// State is a sandbox's state as the API lists it.
type State string

// The states List filters on.
const (
	StateRunning State = "running"
	StatePaused  State = "paused"
)

// Info describes a sandbox (GetInfo, List).
type Info struct {
	SandboxID   string            `json:"sandboxID"`
	TemplateID  string            `json:"templateID"`
	Alias       string            `json:"alias"`
	State       State             `json:"state"`
	Metadata    map[string]string `json:"metadata"`
	StartedAt   time.Time         `json:"startedAt"`
	EndAt       time.Time         `json:"endAt"`
	CPUCount    int               `json:"cpuCount"`
	MemoryMB    int               `json:"memoryMB"`
	DiskSizeMB  int               `json:"diskSizeMB"`
	EnvdVersion string            `json:"envdVersion"`
	// Runtime is CubeSandbox's extension: the runtime it runs on.
	Runtime string `json:"runtime"`
}

// GetInfo describes one sandbox.
func (c *Client) GetInfo(ctx context.Context, sandboxID string) (*Info, error) {
	var out Info
	if _, err := c.do(ctx, "get sandbox "+sandboxID, http.MethodGet, "/sandboxes/"+url.PathEscape(sandboxID), nil, nil, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// ListOptions filter and page List.
type ListOptions struct {
	// Metadata keeps the sandboxes whose metadata has every pair.
	Metadata map[string]string
	// States keeps the sandboxes in one of them; default running and
	// paused.
	States []State
	// Limit is the page size (1-100); default 100.
	Limit int
	// NextToken starts from a page a previous Paginator returned.
	NextToken string
}

// Paginator pages through List's results.
type Paginator struct {
	c       *Client
	opts    ListOptions
	next    string
	hasNext bool
}

// List returns a paginator over the team's sandboxes; call Next for each
// page while HasNext.
func (c *Client) List(opts ListOptions) *Paginator {
	return &Paginator{c: c, opts: opts, next: opts.NextToken, hasNext: true}
}

// HasNext reports whether Next has a page to return.
func (p *Paginator) HasNext() bool { return p.hasNext }

// NextToken is the token of the next page ("" when none).
func (p *Paginator) NextToken() string { return p.next }

// Next returns the next page; after the last page it returns nil.
func (p *Paginator) Next(ctx context.Context) ([]Info, error) {
	if !p.hasNext {
		return nil, nil
	}
	q := url.Values{}
	if len(p.opts.Metadata) > 0 {
		q.Set("metadata", metadataQuery(p.opts.Metadata))
	}
	states := p.opts.States
	if len(states) == 0 {
		states = []State{StateRunning, StatePaused}
	}
	ss := make([]string, len(states))
	for i, s := range states {
		ss[i] = string(s)
	}
	q.Set("state", strings.Join(ss, ","))
	if p.opts.Limit > 0 {
		q.Set("limit", strconv.Itoa(p.opts.Limit))
	}
	if p.next != "" {
		q.Set("nextToken", p.next)
	}
	var out []Info
	h, err := p.c.do(ctx, "list sandboxes", http.MethodGet, "/v2/sandboxes", q, nil, &out)
	if err != nil {
		return nil, err
	}
	p.next = h.Get("X-Next-Token")
	p.hasNext = p.next != ""
	return out, nil
}

// All returns every page.
func (p *Paginator) All(ctx context.Context) ([]Info, error) {
	var all []Info
	for p.HasNext() {
		page, err := p.Next(ctx)
		if err != nil {
			return all, err
		}
		all = append(all, page...)
	}
	return all, nil
}

// metadataQuery is E2B's metadata filter: key=value pairs, each part
// URL-encoded, the whole a query string (encoded once more as a query
// parameter).
func metadataQuery(md map[string]string) string {
	keys := make([]string, 0, len(md))
	for k := range md {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	q := url.Values{}
	for _, k := range keys {
		q.Set(url.QueryEscape(k), url.QueryEscape(md[k]))
	}
	return q.Encode()
}

// SnapshotInfo is a snapshot of a sandbox: create sandboxes from it with
// CreateOptions.Template = SnapshotID.
type SnapshotInfo struct {
	SnapshotID string   `json:"snapshotID"`
	Names      []string `json:"names"`
}

// CreateSnapshot snapshots a running sandbox (it keeps running); name is
// optional.
func (c *Client) CreateSnapshot(ctx context.Context, sandboxID, name string) (*SnapshotInfo, error) {
	body := map[string]any{}
	if name != "" {
		body["name"] = name
	}
	var out SnapshotInfo
	if _, err := c.do(ctx, "snapshot sandbox "+sandboxID, http.MethodPost, "/sandboxes/"+url.PathEscape(sandboxID)+"/snapshots", nil, body, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// ListSnapshots lists the team's snapshots, those of sandboxID when it is
// not empty (the first 100).
func (c *Client) ListSnapshots(ctx context.Context, sandboxID string) ([]SnapshotInfo, error) {
	q := url.Values{}
	if sandboxID != "" {
		q.Set("sandboxID", sandboxID)
	}
	var out []SnapshotInfo
	if _, err := c.do(ctx, "list snapshots", http.MethodGet, "/snapshots", q, nil, &out); err != nil {
		return nil, err
	}
	return out, nil
}

// DeleteSnapshot deletes a snapshot. An unknown one is ErrNotFound.
func (c *Client) DeleteSnapshot(ctx context.Context, snapshotID string) error {
	_, err := c.do(ctx, "delete snapshot "+snapshotID, http.MethodDelete, "/templates/"+url.PathEscape(snapshotID), nil, nil, nil)
	return err
}

// ForkResult is one copy of a Fork: the sandbox, or why it failed.
type ForkResult struct {
	Sandbox *Sandbox
	Err     error
}

// Fork makes count copies of a running sandbox, each with its own ID,
// access token and timeout to live (zero: the service's default). The
// error is non-nil only when the whole request failed; each copy that
// failed has its own Err.
func (c *Client) Fork(ctx context.Context, sandboxID string, count int, timeout time.Duration) ([]ForkResult, error) {
	body := map[string]any{"count": count}
	if timeout > 0 {
		body["timeout"] = seconds(timeout)
	}
	var out []struct {
		Sandbox *sandboxJSON `json:"sandbox"`
		Error   *struct {
			Code    int    `json:"code"`
			Message string `json:"message"`
		} `json:"error"`
	}
	if _, err := c.do(ctx, "fork sandbox "+sandboxID, http.MethodPost, "/sandboxes/"+url.PathEscape(sandboxID)+"/fork", nil, body, &out); err != nil {
		return nil, err
	}
	res := make([]ForkResult, len(out))
	for i, r := range out {
		switch {
		case r.Sandbox != nil:
			res[i].Sandbox = c.sandbox(r.Sandbox)
		case r.Error != nil:
			res[i].Err = fmt.Errorf("fork sandbox %s: %w", sandboxID, &APIError{StatusCode: r.Error.Code, Message: r.Error.Message})
		default:
			res[i].Err = fmt.Errorf("fork sandbox %s: the service returned an empty result", sandboxID)
		}
	}
	return res, nil
}
