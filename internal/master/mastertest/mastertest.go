// Package mastertest runs real cubemasters and real cubelets for tests: a
// master on a private SQLite catalog with its APIs on loopback ports and a
// private socket (in the test's process, or as its own cubemaster process
// that a test can crash: StartMasterProcess), and any number of in-process
// cubelets (each with its own data dir, XFS pool, runc root and cgroup
// parent, from cubelettest) that register with it and heartbeat.
package mastertest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	toml "github.com/pelletier/go-toml/v2"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/cubeletapi"
	"github.com/cubesandbox/cube/internal/cubeletclient"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/server"
	"github.com/cubesandbox/cube/internal/serve"
	"github.com/cubesandbox/cube/internal/testbin"
)

// Master is a running cubemaster.
type Master struct {
	Dir    string
	Config *master.Config
	Server *server.Server
	Socket string
	Admin  masterpb.AdminServiceClient
	conn   *grpc.ClientConn
	t      testing.TB
	logs   lockedBuffer // everything the master logged (Logs)

	// Process mode (StartMasterProcess).
	bin, cfgPath, e2bAddr, tomlText string
	// Failpoints is $CUBE_FAILPOINTS for the next Start in process mode.
	Failpoints string
	proc       *exec.Cmd
	exited     chan struct{}
	state      *os.ProcessState
}

// log is the in-process master's logger: the test's log, and m.logs.
func (m *Master) log() *slog.Logger {
	return slog.New(slog.NewTextHandler(io.MultiWriter(testWriter{m.t}, &m.logs), &slog.HandlerOptions{Level: logLevel()}))
}

// Logs is everything the master logged so far (audit lines included), in
// process mode too.
func (m *Master) Logs() string { return m.logs.String() }

type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Log is a slog.Logger writing to t (debug level with CUBE_TEST_DEBUG=1).
func Log(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: logLevel()}))
}

// logLevel: debug with CUBE_TEST_DEBUG=1; warnings only with
// CUBE_TEST_QUIET=1 (a test that measures memory under many requests: t.Log
// keeps every line in memory).
func logLevel() slog.Level {
	switch {
	case os.Getenv("CUBE_TEST_DEBUG") != "":
		return slog.LevelDebug
	case os.Getenv("CUBE_TEST_QUIET") != "":
		return slog.LevelWarn
	}
	return slog.LevelInfo
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// StartMaster starts a master for t with extra TOML merged over the test
// defaults (fast heartbeats and deadline checks).
func StartMaster(t testing.TB, extraTOML string) *Master {
	t.Helper()
	m := newMaster(t, extraTOML, "127.0.0.1:0")
	m.Start()
	t.Cleanup(m.Stop)
	return m
}

// StartMasterProcess is StartMaster with cubemaster run as a process of
// its own, built with -tags failpoints so that Failpoints ($CUBE_FAILPOINTS)
// can make it fail or SIGKILL itself at a chosen instant. Server is nil;
// the E2B API (API) and the admin socket (Admin) work as in-process.
func StartMasterProcess(t testing.TB, extraTOML string) *Master {
	t.Helper()
	bin := masterBinary(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	m := newMaster(t, extraTOML, addr)
	m.bin, m.e2bAddr = bin, addr
	m.cfgPath = filepath.Join(m.Dir, "cubemaster.toml")
	if err := os.WriteFile(m.cfgPath, []byte(m.tomlText), 0o600); err != nil {
		t.Fatal(err)
	}
	m.Start()
	t.Cleanup(m.Stop)
	return m
}

// masterBinary builds cubemaster with -tags failpoints once per test
// process.
func masterBinary(t testing.TB) string {
	t.Helper()
	return testbin.Build(t, "cubemaster", "failpoints")
}

func newMaster(t testing.TB, extraTOML, e2bAddr string) *Master {
	t.Helper()
	cubelettest.RequireRoot(t)
	dir, err := os.MkdirTemp("", "cube-master-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	m := &Master{Dir: dir, Socket: filepath.Join(dir, "master.sock"), t: t}
	base := fmt.Sprintf(`
[api]
e2b = %q
node = ""
socket = %q
[proxy]
listen = "127.0.0.1:0"
metrics = "127.0.0.1:0"
domain = "cube.test"
[catalog]
dsn = %q
[nodes]
heartbeat_interval = "200ms"
unhealthy_after = "5s"
[sandbox]
expiry_interval = "100ms"
memory_mib = 64
[templates]
store_dir = %q
`, e2bAddr, m.Socket, filepath.Join(dir, "catalog.db"), filepath.Join(dir, "templates"))
	merged, err := mergeTOML(base, extraTOML)
	if err != nil {
		t.Fatalf("extra master config: %v", err)
	}
	m.Config, err = master.ParseConfig([]byte(merged))
	if err != nil {
		t.Fatalf("master config: %v", err)
	}
	m.tomlText = merged
	return m
}

// Start (re)starts the master on its catalog. It logs to, and fails, the
// test that started the master (not a subtest that may end first).
func (m *Master) Start() {
	t := m.t
	t.Helper()
	if m.bin != "" {
		m.startProcess()
	} else {
		srv, err := server.Start(context.Background(), m.Config, m.log())
		if err != nil {
			t.Fatalf("start master: %v", err)
		}
		m.Server = srv
	}
	conn, err := grpc.NewClient("unix://"+m.Socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	m.conn, m.Admin = conn, masterpb.NewAdminServiceClient(conn)
	waitFor(t, 10*time.Second, "master socket", func() bool {
		_, err := m.Admin.ListNodes(context.Background(), &masterpb.ListNodesRequest{})
		return err == nil
	})
}

// Stop stops the master; sandboxes and cubelets keep running. Idempotent.
func (m *Master) Stop() {
	if m.bin != "" {
		m.stopProcess()
		return
	}
	if m.Server == nil {
		return
	}
	m.conn.Close()
	if err := m.Server.Stop(); err != nil {
		m.t.Errorf("stop master: %v", err)
	}
	m.Server = nil
}

func (m *Master) startProcess() {
	t := m.t
	t.Helper()
	cmd := exec.Command(m.bin, "-config", m.cfgPath)
	cmd.Env = append(os.Environ(), "CUBE_FAILPOINTS="+m.Failpoints)
	cmd.Stderr = io.MultiWriter(testWriter{t}, &m.logs)
	cmd.Stdout = io.MultiWriter(testWriter{t}, &m.logs)
	if err := cmd.Start(); err != nil {
		t.Fatalf("start cubemaster: %v", err)
	}
	m.proc, m.exited, m.state = cmd, make(chan struct{}), nil
	exited := m.exited
	go func() {
		_ = cmd.Wait()
		m.state = cmd.ProcessState
		close(exited)
	}()
}

func (m *Master) stopProcess() {
	if m.proc == nil {
		return
	}
	if m.conn != nil {
		m.conn.Close()
	}
	_ = m.proc.Process.Signal(syscall.SIGTERM)
	select {
	case <-m.exited:
	case <-time.After(30 * time.Second):
		m.t.Errorf("cubemaster did not stop within 30s of SIGTERM; killing it")
		_ = m.proc.Process.Kill()
		<-m.exited
	}
	m.proc = nil
}

// Kill SIGKILLs the cubemaster process and waits for it to end. The
// master is then stopped as far as Start is concerned.
func (m *Master) Kill() {
	if m.proc == nil {
		return
	}
	_ = m.proc.Process.Kill()
	<-m.exited
	if m.conn != nil {
		m.conn.Close()
	}
	m.proc = nil
}

// WaitExit waits up to d for the cubemaster process to end by itself
// (a failpoint's kill) and returns how it ended; nil if it still runs.
// The master is then stopped as far as Start is concerned.
func (m *Master) WaitExit(d time.Duration) *os.ProcessState {
	if m.proc == nil {
		return nil
	}
	select {
	case <-m.exited:
	case <-time.After(d):
		return nil
	}
	if m.conn != nil {
		m.conn.Close()
	}
	m.proc = nil
	return m.state
}

// APIKey creates an API key through the admin API.
func (m *Master) APIKey(t testing.TB) string { return m.apiKey(t, false) }

// AdminAPIKey creates an admin API key (template delete).
func (m *Master) AdminAPIKey(t testing.TB) string { return m.apiKey(t, true) }

func (m *Master) apiKey(t testing.TB, admin bool) string {
	t.Helper()
	resp, err := m.Admin.CreateAPIKey(context.Background(), &masterpb.CreateAPIKeyRequest{Name: fmt.Sprintf("test-%d", time.Now().UnixNano()), Admin: admin})
	if err != nil {
		t.Fatal(err)
	}
	return resp.Secret
}

// Node returns the admin view of one node.
func (m *Master) Node(t testing.TB, id string) *masterpb.Node {
	t.Helper()
	resp, err := m.Admin.ListNodes(context.Background(), &masterpb.ListNodesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range resp.Nodes {
		if n.Report.NodeId == id {
			return n
		}
	}
	return nil
}

// WaitHealthy waits until every node is registered, healthy, and has
// reported each template it was started with.
func (m *Master) WaitHealthy(t testing.TB, nodes ...*Node) {
	t.Helper()
	for _, n := range nodes {
		waitFor(t, 15*time.Second, "node "+n.ID+" healthy with its templates", func() bool {
			v := m.Node(t, n.ID)
			if v == nil || !v.Healthy {
				return false
			}
			have := map[string]bool{}
			for _, tr := range v.Report.Templates {
				have[tr.Id] = true
			}
			for _, id := range n.Templates {
				if !have[id] {
					return false
				}
			}
			return true
		})
	}
}

// Node is a real cubelet registered with a master.
type Node struct {
	ID        string
	Templates []string // imported at start
	Env       *cubelettest.Env
	Svc       *cubelet.Service
	Client    cubeletpb.CubeletServiceClient
	stop      context.CancelFunc
	done      chan struct{}
	closed    bool
	t         testing.TB // the test that owns the node: logs, cleanups
}

// StartNode starts a cubelet that registers with m and has the busybox
// test image imported as each of templates.
func StartNode(t testing.TB, m *Master, templates ...string) *Node {
	t.Helper()
	return StartNodeConfig(t, m, "", templates...)
}

// StartNodeConfig is StartNode with extra cubelet TOML (tables other
// than [master]), e.g. to leave a runtime out.
func StartNodeConfig(t testing.TB, m *Master, extraTOML string, templates ...string) *Node {
	t.Helper()
	return StartNodeReplicas(t, []*Master{m}, extraTOML, templates...)
}

// StartNodeReplicas is StartNodeConfig for a node that reports to one of
// several master replicas (the first that answers; the next when it goes).
func StartNodeReplicas(t testing.TB, ms []*Master, extraTOML string, templates ...string) *Node {
	t.Helper()
	var addrs []string
	for _, m := range ms {
		addrs = append(addrs, "unix://"+m.Socket)
	}
	env := cubelettest.New(t, fmt.Sprintf("[master]\naddr = %q\nheartbeat_interval = \"200ms\"\n%s", strings.Join(addrs, ","), extraTOML))
	n := &Node{ID: env.Config.Node.ID, Env: env, Templates: templates, t: t}
	t.Cleanup(n.Stop)
	n.Start()
	for _, id := range templates {
		env.ImportBusybox(t, n.Svc, id)
	}
	conn, err := cubeletclient.Dial(env.Config.API.Socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	n.Client = cubeletclient.New(conn)
	return n
}

// Start (re)starts the cubelet and its API. The cubelet is closed at the
// end of the owning test unless Stop closed it first.
func (n *Node) Start() {
	t := n.t
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	svc, err := cubelet.New(ctx, n.Env.Config, Log(t).With("node", n.ID))
	if err != nil {
		t.Fatalf("start cubelet: %v", err)
	}
	n.Svc, n.closed = svc, false
	n.StartAPI()
}

// StartAPI serves the cubelet's gRPC API.
func (n *Node) StartAPI() {
	t := n.t
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	n.stop, n.done = cancel, make(chan struct{})
	svc, done := n.Svc, n.done
	go func() { _ = cubeletapi.Serve(ctx, svc, Log(t)); close(done) }()
	waitFor(t, 10*time.Second, "cubelet socket", func() bool {
		return serve.Accepting(n.Env.Config.API.Socket)
	})
}

// StopAPI stops serving the gRPC API; the cubelet (and its heartbeats)
// keep running. Idempotent.
func (n *Node) StopAPI() {
	if n.stop != nil {
		n.stop()
		<-n.done
		n.stop = nil
	}
}

// Stop stops the API and the cubelet: heartbeats stop, sandboxes keep
// running. Idempotent.
func (n *Node) Stop() {
	n.StopAPI()
	if n.closed || n.Svc == nil {
		return
	}
	n.closed = true
	if err := n.Svc.Close(); err != nil {
		n.t.Errorf("close cubelet: %v", err)
	}
}

func waitFor(t testing.TB, d time.Duration, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// WaitFor polls ok every 20 ms until it holds or d passes.
func WaitFor(t testing.TB, d time.Duration, what string, ok func() bool) {
	t.Helper()
	waitFor(t, d, what, ok)
}

// Client is an E2B REST client with one API key.
type Client struct {
	Base string
	Key  string
	HC   *http.Client
}

// API returns a REST client for the master's E2B API.
func (m *Master) API(key string) *Client {
	addr := m.e2bAddr
	if m.Server != nil {
		addr = m.Server.E2BAddr
	}
	return &Client{Base: "http://" + addr, Key: key, HC: &http.Client{Timeout: 2 * time.Minute}}
}

// Do sends a request with a JSON body (nil for none) and decodes a JSON
// answer into out (nil to ignore). It returns the response with its body
// read into Body.
func (c *Client) Do(t testing.TB, method, path string, body, out any) *Response {
	t.Helper()
	var rd io.Reader
	if body != nil {
		if s, ok := body.(string); ok {
			rd = strings.NewReader(s)
		} else {
			b, err := json.Marshal(body)
			if err != nil {
				t.Fatal(err)
			}
			rd = bytes.NewReader(b)
		}
	}
	req, err := http.NewRequest(method, c.Base+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	r, err := c.Try(req, out)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	return r
}

// Try sends req (its X-API-KEY set from c) and decodes a JSON 2xx answer
// into out (nil to ignore); a transport or decoding error is returned,
// not fatal: the master may die during the call.
func (c *Client) Try(req *http.Request, out any) (*Response, error) {
	if c.Key != "" {
		req.Header.Set("X-API-KEY", c.Key)
	}
	resp, err := c.HC.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if out != nil && resp.StatusCode/100 == 2 && len(data) > 0 {
		if err := json.Unmarshal(data, out); err != nil {
			return nil, fmt.Errorf("decode %s: %w", data, err)
		}
	}
	return &Response{Response: resp, Body: data}, nil
}

// Response is an answer with its body.
type Response struct {
	*http.Response
	Body []byte
}

// Error decodes an E2B error body.
func (r *Response) Error() (code int, message string) {
	var e struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	}
	_ = json.Unmarshal(r.Body, &e)
	return e.Code, e.Message
}

// mergeTOML lays extra over base table by table (concatenating would
// define a table twice).
func mergeTOML(base, extra string) (string, error) {
	var b, e map[string]any
	if err := toml.Unmarshal([]byte(base), &b); err != nil {
		return "", err
	}
	if err := toml.Unmarshal([]byte(extra), &e); err != nil {
		return "", err
	}
	merge(b, e)
	out, err := toml.Marshal(b)
	return string(out), err
}

func merge(dst, src map[string]any) {
	for k, v := range src {
		if sm, ok := v.(map[string]any); ok {
			if dm, ok := dst[k].(map[string]any); ok {
				merge(dm, sm)
				continue
			}
		}
		dst[k] = v
	}
}
