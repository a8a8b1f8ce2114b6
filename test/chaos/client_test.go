package chaos

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net/http"
	"sort"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	pb "github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/proxy"
)

// payloadPath is where each sandbox holds its client's payload: on the
// root filesystem, so snapshots, forks and creates from snapshots carry it.
const payloadPath = "/root/chaos.bin"

// sbx is what a client believes about one of its sandboxes.
type sbx struct {
	id, token, tag string
	state          string // "running" or "paused"
	// payload is the file's content; nil when a write failed (its content
	// is then unknown until the next successful write).
	payload []byte
	// uncertain: the last verb's outcome is unknown (no answer, or an
	// error answer); the client asks GET /sandboxes/{id} before the next.
	uncertain bool
	// killSent: a kill was sent and answered with an error or not at
	// all. The node may still carry it out (the master answers 503 when
	// cubelet dies mid-call; cubelet's journal finishes the delete after
	// its restart), so the sandbox may vanish later.
	killSent bool
}

// snap is a snapshot a client made, with the payload it holds.
type snap struct {
	id, name string
	payload  []byte
}

// outcome of one client operation.
type outcome int

const (
	ok     outcome = iota
	failed         // the API answered with an error
	lost           // no answer (connection refused or reset: the master died)
)

// opStat counts one kind of operation.
type opStat struct {
	OK, Failed, Lost int
	Errors           []string `json:",omitempty"` // the first few, with the time they happened
}

// ledger is shared by the clients: counts, findings, the sets the final
// check compares with the system's.
type ledger struct {
	mu        sync.Mutex
	begin     time.Time
	ops       map[string]*opStat
	findings  []string        // byte mismatches and lost sandboxes: the test fails on any
	ambiguous map[string]bool // create/fork tags and snapshot names whose answer never came
	refused   map[string]string
	done      int             // counted operations (not the GETs that resolve an uncertain state)
	lateKills int             // kills answered with an error that took effect later
	dead      map[string]bool // sandboxes that died under a client (findings already)
}

func newLedger() *ledger {
	return &ledger{begin: time.Now(), ops: map[string]*opStat{}, ambiguous: map[string]bool{}, refused: map[string]string{}, dead: map[string]bool{}}
}

func (l *ledger) record(op string, o outcome, detail string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	st := l.ops[op]
	if st == nil {
		st = &opStat{}
		l.ops[op] = st
	}
	switch o {
	case ok:
		st.OK++
	case failed:
		st.Failed++
	case lost:
		st.Lost++
	}
	if o != ok && len(st.Errors) < 8 {
		st.Errors = append(st.Errors, fmt.Sprintf("t+%.1fs %s", time.Since(l.begin).Seconds(), detail))
	}
	if op != "get" {
		l.done++
	}
}

func (l *ledger) finding(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.findings = append(l.findings, fmt.Sprintf("t+%.1fs ", time.Since(l.begin).Seconds())+fmt.Sprintf(format, args...))
}

func (l *ledger) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.done
}

// client is one E2B user: it owns its sandboxes and snapshots and knows
// only what the API told it.
type client struct {
	n     int
	run   string
	s     *system
	l     *ledger
	rng   *mrand.Rand
	hc    *http.Client
	seq   int
	sbs   []*sbx
	snaps []*snap
	// max sandboxes and snapshots it keeps (bounds the node's load).
	maxSandboxes, maxSnaps int
	// backoff: the last operation failed; the client waits a moment, as
	// an SDK user retrying would, before the next.
	backoff bool
}

func (c *client) note(op string, o outcome, detail string) {
	c.l.record(op, o, detail)
	if o != ok {
		c.backoff = true
	}
}

// pace sleeps after a failed operation.
func (c *client) pace() {
	if c.backoff {
		c.backoff = false
		time.Sleep(time.Duration(300+c.rng.IntN(400)) * time.Millisecond)
	}
}

func newClient(n int, run string, s *system, l *ledger) *client {
	var seed [32]byte
	_, _ = rand.Read(seed[:])
	return &client{n: n, run: run, s: s, l: l, rng: mrand.New(mrand.NewChaCha8(seed)),
		hc: &http.Client{Timeout: 3 * time.Minute}, maxSandboxes: 3, maxSnaps: 2}
}

func (c *client) tag() string {
	c.seq++
	return fmt.Sprintf("%s-c%d-%d", c.run, c.n, c.seq)
}

// api calls the E2B REST API. err is set only when no answer came.
func (c *client) api(method, path string, body any) (int, []byte, error) {
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, c.s.api+path, rd)
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set("X-API-Key", c.s.key)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, nil, err
	}
	return resp.StatusCode, data, nil
}

// routeTransport sends a request to a sandbox's agent through the route,
// as the SDK does: by headers, with the sandbox's access token.
type routeTransport struct{ id, token string }

func (r routeTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	req = req.Clone(req.Context())
	req.Header.Set(proxy.HeaderSandboxID, r.id)
	req.Header.Set(proxy.HeaderSandboxPort, fmt.Sprint(agentproto.Port))
	req.Header.Set("X-Access-Token", r.token)
	return http.DefaultTransport.RoundTrip(req)
}

func (c *client) agent(sb *sbx) *http.Client {
	return &http.Client{Timeout: time.Minute, Transport: routeTransport{sb.id, sb.token}}
}

// classify turns an answer into an outcome and a detail line.
func classify(code int, body []byte, err error, want ...int) (outcome, string) {
	if err != nil {
		return lost, err.Error()
	}
	for _, w := range want {
		if code == w {
			return ok, ""
		}
	}
	return failed, fmt.Sprintf("%d %s", code, strings.TrimSpace(string(body)))
}

func randomPayload(rng *mrand.Rand) []byte {
	b := make([]byte, 1+rng.IntN(64<<10))
	_, _ = rand.Read(b)
	return b
}

// step runs one operation picked at random among those that make sense
// for what the client believes.
func (c *client) step() {
	for _, sb := range c.sbs {
		if sb.uncertain {
			c.resolve(sb)
			return
		}
	}
	type choice struct {
		w  int
		fn func()
	}
	var cs []choice
	add := func(w int, fn func()) { cs = append(cs, choice{w, fn}) }
	if len(c.sbs) < c.maxSandboxes {
		add(20, func() { c.create("base", nil) })
		if len(c.snaps) > 0 {
			sn := c.snaps[c.rng.IntN(len(c.snaps))]
			add(8, func() { c.create(sn.id, sn.payload) })
		}
	}
	for _, sb := range c.sbs {
		switch sb.state {
		case "running":
			add(6, func() { c.write(sb) })
			add(6, func() { c.verify(sb) })
			add(4, func() { c.pause(sb) })
			if len(c.snaps) < c.maxSnaps {
				add(3, func() { c.snapshot(sb) })
			}
			if len(c.sbs) < c.maxSandboxes {
				add(3, func() { c.fork(sb) })
			}
		case "paused":
			add(6, func() { c.resume(sb) })
		}
		add(3, func() { c.kill(sb) })
	}
	if len(c.snaps) >= c.maxSnaps {
		add(3, func() { c.deleteSnapshot(c.snaps[0]) })
	}
	total := 0
	for _, ch := range cs {
		total += ch.w
	}
	r := c.rng.IntN(total)
	for _, ch := range cs {
		if r < ch.w {
			ch.fn()
			return
		}
		r -= ch.w
	}
}

type created struct {
	SandboxID       string `json:"sandboxID"`
	EnvdAccessToken string `json:"envdAccessToken"`
}

// create makes a sandbox of template (the base template or one of the
// client's snapshots, whose payload it then holds) and writes a fresh
// payload into a new one.
func (c *client) create(template string, payload []byte) {
	tag := c.tag()
	code, body, err := c.api("POST", "/v2/sandboxes", map[string]any{
		"templateID": template, "timeout": 3600, "metadata": map[string]string{"chaos": c.run, "tag": tag},
	})
	op := "create"
	if template != "base" {
		op = "create from snapshot"
	}
	o, detail := classify(code, body, err, http.StatusCreated)
	c.note(op, o, detail)
	switch o {
	case lost:
		c.l.mu.Lock()
		c.l.ambiguous[tag] = true
		c.l.mu.Unlock()
		return
	case failed:
		c.l.mu.Lock()
		c.l.refused[tag] = detail
		c.l.mu.Unlock()
		return
	}
	var r created
	if err := json.Unmarshal(body, &r); err != nil || r.SandboxID == "" {
		c.l.finding("create %s: undecodable answer %s", tag, body)
		return
	}
	sb := &sbx{id: r.SandboxID, token: r.EnvdAccessToken, tag: tag, state: "running", payload: payload}
	c.sbs = append(c.sbs, sb)
	if template == "base" {
		c.write(sb)
	}
}

// write replaces the sandbox's payload through the agent's /files.
func (c *client) write(sb *sbx) {
	p := randomPayload(c.rng)
	req, _ := http.NewRequest("POST", c.s.route+"/files?username=root&path="+payloadPath, bytes.NewReader(p))
	req.Header.Set("Content-Type", "application/octet-stream")
	resp, err := c.agent(sb).Do(req)
	var code int
	var body []byte
	if err == nil {
		code = resp.StatusCode
		body, err = io.ReadAll(resp.Body)
		resp.Body.Close()
	}
	o, detail := classify(code, body, err, http.StatusOK)
	c.note("write file", o, sb.id+": "+detail)
	if o == ok {
		sb.payload = p
		return
	}
	// An upload overwrites in place: after a failed one the content is
	// unknown until the next write succeeds.
	sb.payload = nil
	if code == http.StatusConflict || code == http.StatusNotFound || code == http.StatusBadGateway {
		sb.uncertain = true // the route says the sandbox is not running
	}
}

// verify reads the payload back through /files and checks its digest with
// a command run through the process API: both must be byte-exact.
func (c *client) verify(sb *sbx) {
	if sb.payload == nil {
		c.write(sb)
		return
	}
	req, _ := http.NewRequest("GET", c.s.route+"/files?username=root&path="+payloadPath, nil)
	resp, err := c.agent(sb).Do(req)
	var code int
	var body []byte
	if err == nil {
		code = resp.StatusCode
		body, err = io.ReadAll(resp.Body)
		resp.Body.Close()
	}
	o, detail := classify(code, body, err, http.StatusOK)
	c.note("read file", o, sb.id+": "+detail)
	if o == ok && !bytes.Equal(body, sb.payload) {
		c.l.finding("%s: /files returned %d bytes (sha256 %s), want %d (sha256 %s)", sb.id, len(body), digest(body), len(sb.payload), digest(sb.payload))
	}
	if o != ok {
		return
	}
	out, err := c.exec(sb, "sha256sum "+payloadPath)
	if err != nil {
		c.note("exec", failed, sb.id+": "+err.Error())
		return
	}
	c.note("exec", ok, "")
	if got, _, _ := strings.Cut(strings.TrimSpace(out), " "); got != digest(sb.payload) {
		c.l.finding("%s: sha256sum in the sandbox says %q, want %s", sb.id, out, digest(sb.payload))
	}
}

func digest(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// exec runs a shell command as root through the envd process API via the
// route and returns its stdout; an error unless it exits 0.
func (c *client) exec(sb *sbx, script string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	req := connect.NewRequest(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", script}}})
	req.Header().Set("Authorization", "Basic cm9vdDo=") // root:
	s, err := processconnect.NewProcessClient(c.agent(sb), c.s.route).Start(ctx, req)
	if err != nil {
		return "", err
	}
	defer s.Close()
	var out []byte
	var end *pb.ProcessEvent_EndEvent
	for s.Receive() {
		ev := s.Msg().GetEvent()
		out = append(out, ev.GetData().GetStdout()...)
		if e := ev.GetEnd(); e != nil {
			end = e
		}
	}
	if err := s.Err(); err != nil {
		return "", err
	}
	if end == nil || end.GetExitCode() != 0 {
		return "", fmt.Errorf("%q: end %v, output %q", script, end, out)
	}
	return string(out), nil
}

func (c *client) pause(sb *sbx) {
	code, body, err := c.api("POST", "/sandboxes/"+sb.id+"/pause", nil)
	o, detail := classify(code, body, err, http.StatusNoContent)
	c.note("pause", o, sb.id+": "+detail)
	if o == ok {
		sb.state = "paused"
		return
	}
	sb.uncertain = true
}

func (c *client) resume(sb *sbx) {
	code, body, err := c.api("POST", "/sandboxes/"+sb.id+"/resume", map[string]any{"timeout": 3600})
	o, detail := classify(code, body, err, http.StatusCreated)
	c.note("resume", o, sb.id+": "+detail)
	if o == ok {
		sb.state = "running"
		return
	}
	sb.uncertain = true
}

func (c *client) snapshot(sb *sbx) {
	name := c.tag()
	code, body, err := c.api("POST", "/sandboxes/"+sb.id+"/snapshots", map[string]any{"name": name})
	o, detail := classify(code, body, err, http.StatusCreated)
	c.note("snapshot", o, sb.id+": "+detail)
	switch o {
	case lost:
		c.l.mu.Lock()
		c.l.ambiguous[name] = true
		c.l.mu.Unlock()
		sb.uncertain = true
		return
	case failed:
		c.l.mu.Lock()
		c.l.refused[name] = detail
		c.l.mu.Unlock()
		sb.uncertain = true
		return
	}
	var r struct {
		SnapshotID string `json:"snapshotID"`
	}
	if err := json.Unmarshal(body, &r); err != nil || r.SnapshotID == "" {
		c.l.finding("snapshot of %s: undecodable answer %s", sb.id, body)
		return
	}
	c.snaps = append(c.snaps, &snap{id: r.SnapshotID, name: name, payload: sb.payload})
}

func (c *client) fork(sb *sbx) {
	code, body, err := c.api("POST", "/sandboxes/"+sb.id+"/fork", map[string]any{"timeout": 3600})
	o, detail := classify(code, body, err, http.StatusCreated)
	var res []struct {
		Sandbox *created `json:"sandbox"`
		Error   *struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	if o == ok {
		if err := json.Unmarshal(body, &res); err != nil || len(res) != 1 {
			c.l.finding("fork of %s: undecodable answer %s", sb.id, body)
			return
		}
		if res[0].Error != nil {
			o, detail = failed, res[0].Error.Message
		}
	}
	c.note("fork", o, sb.id+": "+detail)
	switch o {
	case lost:
		// The fork, if it happened, carries its parent's metadata.
		c.l.mu.Lock()
		c.l.ambiguous[sb.tag] = true
		c.l.mu.Unlock()
		sb.uncertain = true
		return
	case failed:
		sb.uncertain = true
		return
	}
	c.sbs = append(c.sbs, &sbx{id: res[0].Sandbox.SandboxID, token: res[0].Sandbox.EnvdAccessToken, tag: sb.tag, state: "running", payload: sb.payload})
}

func (c *client) kill(sb *sbx) {
	code, body, err := c.api("DELETE", "/sandboxes/"+sb.id, nil)
	o, detail := classify(code, body, err, http.StatusNoContent)
	c.note("kill", o, sb.id+": "+detail)
	if o == ok {
		c.forget(sb)
		return
	}
	sb.uncertain, sb.killSent = true, true
}

func (c *client) forget(sb *sbx) {
	for i, x := range c.sbs {
		if x == sb {
			c.sbs = append(c.sbs[:i], c.sbs[i+1:]...)
			return
		}
	}
}

func (c *client) deleteSnapshot(sn *snap) {
	code, body, err := c.api("DELETE", "/templates/"+sn.id, nil)
	o, detail := classify(code, body, err, http.StatusNoContent, http.StatusNotFound)
	c.note("delete snapshot", o, sn.id+": "+detail)
	if o == ok {
		for i, x := range c.snaps {
			if x == sn {
				c.snaps = append(c.snaps[:i], c.snaps[i+1:]...)
				break
			}
		}
		return
	}
	// Unknown: it may be gone; the final check looks it up by name.
	c.l.mu.Lock()
	c.l.ambiguous[sn.name] = true
	c.l.mu.Unlock()
	for i, x := range c.snaps {
		if x == sn {
			c.snaps = append(c.snaps[:i], c.snaps[i+1:]...)
			break
		}
	}
}

// resolve asks the API what became of a sandbox after a verb whose outcome
// the client does not know, as an SDK user would. It reports whether the
// state is known now.
func (c *client) resolve(sb *sbx) bool {
	code, body, err := c.api("GET", "/sandboxes/"+sb.id, nil)
	o, detail := classify(code, body, err, http.StatusOK, http.StatusNotFound)
	c.note("get", o, sb.id+": "+detail)
	if o != ok {
		time.Sleep(200 * time.Millisecond)
		return false
	}
	if code == http.StatusNotFound {
		if !sb.killSent {
			c.l.finding("%s (%s): gone though no kill was sent", sb.id, sb.tag)
		} else {
			c.l.mu.Lock()
			c.l.lateKills++
			c.l.mu.Unlock()
		}
		c.forget(sb)
		return true
	}
	var d struct {
		State string `json:"state"`
	}
	_ = json.Unmarshal(body, &d)
	switch d.State {
	case "running", "paused":
		sb.state = d.State
		sb.uncertain = false
		return true
	case "failed":
		// Dead without a kill: the client lost it.
		c.l.finding("%s (%s): %s: the sandbox died (no kill was sent: %v)", sb.id, sb.tag, body, !sb.killSent)
		c.l.mu.Lock()
		c.l.dead[sb.id] = true
		c.l.mu.Unlock()
		c.forget(sb)
		return true
	}
	// A transition in progress: ask again later.
	time.Sleep(200 * time.Millisecond)
	return false
}

// sortedKeys is for stable messages.
func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
