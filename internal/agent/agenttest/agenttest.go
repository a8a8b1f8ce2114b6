// Package agenttest is the conformance suite of cube-agent's envd API: one
// set of tests that runs against any agent, in-process (fast, on every
// change) and inside a real sandbox (through cubelet and runc), so both
// are held to the same wire behaviour.
//
// The suite assumes the agent's users are "root" (uid 0) and "user"
// (uid 1000, home Target.UserHome), as in the busybox test template, that
// the agent starts with default user "user" and no /init applied, and it
// leaves the agent that way.
package agenttest

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/cubesandbox/cube/api/envd/filesystem/filesystemconnect"
	pb "github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
)

// Target is an agent under test.
type Target struct {
	// URL is the agent's base URL, e.g. http://127.0.0.1:49983.
	URL string
	// Dial connects to the agent's address (through a network namespace
	// for a sandbox); net.Dialer's when nil.
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
	// UserHome is the home directory of "user"; it must exist, belong
	// to uid 1000 and be reachable by it.
	UserHome string
	// RootOnly is a directory only root may enter (mode 0700).
	RootOnly string
	// Env are variables the sandbox was created with: every process
	// must see them.
	Env map[string]string
	// Sandbox says the agent runs in a real runc sandbox: no
	// CAP_SYS_ADMIN or CAP_SYS_TIME, a small disk, PID 1.
	Sandbox bool
}

// Run runs the whole suite against tg.
func Run(t *testing.T, tg Target) {
	h := newHarness(t, tg)
	t.Run("Health", h.testHealth)
	t.Run("Process", h.testProcess)
	t.Run("Filesystem", h.testFilesystem)
	t.Run("Files", h.testFiles)
	t.Run("Admin", h.testAdmin)
	t.Run("BadInput", h.testBadInput)
	// Last: it changes /init state (and puts it back).
	t.Run("InitAndAuth", h.testInitAndAuth)
}

// harness holds clients for one Target.
type harness struct {
	tg Target
	// h1 speaks HTTP/1.1 only, as the SDKs' fetch transports do; h2c
	// speaks cleartext HTTP/2 with prior knowledge.
	h1, h2c *http.Client
	// JSON over HTTP/1.1 (what the E2B JS SDK sends) and binary over h2c.
	proc, procBin processconnect.ProcessClient
	fs, fsBin     filesystemconnect.FilesystemClient
	token         string // X-Access-Token to send, when set
}

func newHarness(t *testing.T, tg Target) *harness {
	t.Helper()
	dial := tg.Dial
	if dial == nil {
		dial = (&net.Dialer{}).DialContext
	}
	transport := func(h2c bool) *http.Transport {
		p := new(http.Protocols)
		if h2c {
			p.SetUnencryptedHTTP2(true)
		} else {
			p.SetHTTP1(true)
		}
		return &http.Transport{Proxy: nil, DialContext: dial, Protocols: p, MaxIdleConnsPerHost: 8}
	}
	h := &harness{tg: tg, h1: &http.Client{Transport: transport(false)}, h2c: &http.Client{Transport: transport(true)}}
	t.Cleanup(func() {
		h.h1.CloseIdleConnections()
		h.h2c.CloseIdleConnections()
	})
	h.proc = processconnect.NewProcessClient(h.h1, tg.URL, connect.WithProtoJSON())
	h.procBin = processconnect.NewProcessClient(h.h2c, tg.URL)
	h.fs = filesystemconnect.NewFilesystemClient(h.h1, tg.URL, connect.WithProtoJSON())
	h.fsBin = filesystemconnect.NewFilesystemClient(h.h2c, tg.URL)
	return h
}

func ctxT(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// as prepares a Connect request acting as user ("" = the default user).
func as[T any](h *harness, user string, msg *T) *connect.Request[T] {
	r := connect.NewRequest(msg)
	if user != "" {
		r.Header().Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte(user+":")))
	}
	if h.token != "" {
		r.Header().Set("X-Access-Token", h.token)
	}
	return r
}

// result is everything a Start stream delivered.
type result struct {
	pid        uint32
	stdout     string
	stderr     string
	pty        string
	end        *pb.ProcessEvent_EndEvent
	keepalives int
}

// run starts a process and collects its stream until the end.
func (h *harness) run(ctx context.Context, c processconnect.ProcessClient, req *connect.Request[pb.StartRequest]) (result, error) {
	var r result
	s, err := c.Start(ctx, req)
	if err != nil {
		return r, err
	}
	defer s.Close()
	for s.Receive() {
		r.add(s.Msg().GetEvent())
	}
	return r, s.Err()
}

func (r *result) add(ev *pb.ProcessEvent) {
	switch e := ev.GetEvent().(type) {
	case *pb.ProcessEvent_Start:
		r.pid = e.Start.GetPid()
	case *pb.ProcessEvent_Data:
		r.stdout += string(e.Data.GetStdout())
		r.stderr += string(e.Data.GetStderr())
		r.pty += string(e.Data.GetPty())
	case *pb.ProcessEvent_End:
		r.end = e.End
	case *pb.ProcessEvent_Keepalive:
		r.keepalives++
	}
}

// sh builds a StartRequest running a shell script.
func sh(script string) *pb.StartRequest {
	return &pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", script}}}
}

// do sends a raw HTTP request and returns status and body.
func (h *harness) do(t *testing.T, c *http.Client, method, path string, body io.Reader, hdr map[string]string) (int, []byte, http.Header) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctxT(t), method, h.tg.URL+path, body)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	if h.token != "" && req.Header.Get("X-Access-Token") == "" {
		req.Header.Set("X-Access-Token", h.token)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: read: %v", method, path, err)
	}
	return resp.StatusCode, b, resp.Header
}

// wantCode fails unless err is a Connect error with code want.
func wantCode(t *testing.T, what string, err error, want connect.Code) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: succeeded, want %v", what, want)
		return
	}
	if got := connect.CodeOf(err); got != want {
		t.Errorf("%s: code %v (%v), want %v", what, got, err, want)
	}
}

// envdError decodes envd's JSON error body.
func envdError(t *testing.T, b []byte) (int, string) {
	t.Helper()
	var e struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	}
	if err := json.Unmarshal(b, &e); err != nil {
		t.Errorf("error body is not envd JSON: %q", b)
	}
	return e.Code, e.Message
}

// healthy fails unless the agent still answers /health.
func (h *harness) healthy(t *testing.T) {
	t.Helper()
	if code, b, _ := h.do(t, h.h1, "GET", "/health", nil, nil); code != http.StatusNoContent {
		t.Fatalf("agent unhealthy: %d %s", code, b)
	}
}

// eventually polls cond for up to 10 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (h *harness) listPIDs(t *testing.T) map[uint32]string {
	t.Helper()
	res, err := h.proc.List(ctxT(t), as(h, "", &pb.ListRequest{}))
	if err != nil {
		t.Fatalf("list: %v", err)
	}
	out := map[uint32]string{}
	for _, p := range res.Msg.GetProcesses() {
		out[p.GetPid()] = p.GetTag()
	}
	return out
}

func (h *harness) testHealth(t *testing.T) {
	for _, c := range []*http.Client{h.h1, h.h2c} {
		req, _ := http.NewRequestWithContext(ctxT(t), "GET", h.tg.URL+"/health", nil)
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusNoContent {
			t.Fatalf("health = %d", resp.StatusCode)
		}
		want := 1
		if c == h.h2c {
			want = 2
		}
		if resp.ProtoMajor != want {
			t.Errorf("served over HTTP/%d, want HTTP/%d", resp.ProtoMajor, want)
		}
	}
	if code, _, _ := h.do(t, h.h1, "POST", "/health", nil, nil); code != http.StatusMethodNotAllowed {
		t.Errorf("POST /health = %d, want 405", code)
	}
	if code, _, _ := h.do(t, h.h1, "GET", "/no/such/path", nil, nil); code != http.StatusNotFound {
		t.Errorf("unknown path = %d, want 404", code)
	}
}

// upload writes data to path as user with an octet-stream POST /files.
func (h *harness) upload(t *testing.T, user, path string, data []byte) {
	t.Helper()
	q := "/files?path=" + urlQuery(path)
	if user != "" {
		q += "&username=" + user
	}
	code, b, _ := h.do(t, h.h1, "POST", q, bytes.NewReader(data), map[string]string{"Content-Type": "application/octet-stream"})
	if code != http.StatusOK {
		t.Fatalf("upload %s: %d %s", path, code, b)
	}
}

// download reads path as user.
func (h *harness) download(t *testing.T, user, path string) []byte {
	t.Helper()
	q := "/files?path=" + urlQuery(path)
	if user != "" {
		q += "&username=" + user
	}
	code, b, _ := h.do(t, h.h1, "GET", q, nil, nil)
	if code != http.StatusOK {
		t.Fatalf("download %s: %d %s", path, code, b)
	}
	return b
}

func urlQuery(s string) string {
	r := strings.NewReplacer("%", "%25", "&", "%26", "+", "%2B", " ", "%20", "#", "%23", "?", "%3F")
	return r.Replace(s)
}

func fmtEnd(e *pb.ProcessEvent_EndEvent) string {
	if e == nil {
		return "<no end>"
	}
	return fmt.Sprintf("code=%d exited=%v status=%q error=%q", e.GetExitCode(), e.GetExited(), e.GetStatus(), e.GetError())
}
