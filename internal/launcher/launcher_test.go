package launcher_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/cubeletclient"
	"github.com/cubesandbox/cube/internal/launcher"
	"github.com/cubesandbox/cube/internal/leakcheck"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/serve"
	"github.com/cubesandbox/cube/internal/storage"
	"github.com/cubesandbox/cube/internal/testimage"
)

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func freePort(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// binaries puts cubelet, cube-agent and a fresh cubemaster in one dir.
func binaries(t *testing.T) string {
	shared := cubelettest.Binaries(t)
	dir := t.TempDir()
	for _, b := range []string{"cubelet", "cube-agent"} {
		if err := os.Link(filepath.Join(shared, b), filepath.Join(dir, b)); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command("go", "build", "-trimpath", "-o", filepath.Join(dir, "cubemaster"), "./cmd/cubemaster")
	cmd.Dir = cubelettest.RepoRoot()
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build cubemaster: %v\n%s", err, out)
	}
	return dir
}

// TestUp runs `cube up` for real (child processes, generated configs, the
// default template, the API key), uses the system through its E2B API and
// route, stops it, starts it again, and checks the sandbox and the key
// survived.
func TestUp(t *testing.T) {
	cubelettest.RequireRoot(t)
	bin := binaries(t)
	layout, err := testimage.Busybox(context.Background(), filepath.Join(os.TempDir(), "cube-test-busybox"))
	if err != nil {
		t.Fatal(err)
	}
	root, err := os.MkdirTemp("", "cube-up-")
	if err != nil {
		t.Fatal(err)
	}
	// Searchable (not listable) like /run: a runc sandbox's mapped root
	// must reach its idmapped root filesystem under the run dir.
	if err := os.Chmod(root, 0o711); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	id := hex.EncodeToString(b)
	out := &syncBuffer{}
	nodeAPI, cubeletTCP := freePort(t), freePort(t)
	cfg := launcher.Config{
		StateDir: filepath.Join(root, "state"), RunDir: filepath.Join(root, "run"), LogDir: filepath.Join(root, "log"),
		BinDir: bin, APIAddr: freePort(t), ProxyAddr: freePort(t), Template: "busybox", TemplateSource: layout,
		ExtraMasterTOML: fmt.Sprintf("[api]\nnode = %q\n[nodes]\nheartbeat_interval = \"200ms\"\nunhealthy_after = \"3s\"\n", nodeAPI),
		ExtraCubeletTOML: fmt.Sprintf("[node]\nid = \"up-%[1]s\"\ncgroup_parent = \"cube-test-%[1]s\"\n[api]\ntcp = %[2]q\nmetrics = \"\"\n"+
			"[storage]\npool_image_size_mib = 4096\ntemplate_headroom_mib = 32\n[gc]\ninterval = \"200ms\"\n", id, cubeletTCP),
		Out: out, Log: mastertest.Log(t),
	}
	scope := leakcheck.Scope{
		DataDir: cfg.StateDir, RunDir: cfg.RunDir, RuncRoot: filepath.Join(cfg.RunDir, "runc"), CgroupName: "cube-test-" + id,
		AllowMounts: []string{filepath.Join(cfg.StateDir, "pool")}, AllowLoopBacking: []string{filepath.Join(cfg.StateDir, "pool.img")},
	}
	t.Cleanup(func() {
		if p, err := storage.OpenPool(context.Background(), storage.PoolConfig{Dir: filepath.Join(cfg.StateDir, "pool"), ImageSizeBytes: 1 << 30}); err == nil {
			_ = p.Teardown(context.Background())
		}
		os.RemoveAll(root)
	})

	type running struct {
		cancel context.CancelFunc
		done   chan error
	}
	up := func() running {
		ctx, cancel := context.WithCancel(context.Background())
		r := running{cancel: cancel, done: make(chan error, 1)}
		mark := len(out.String())
		go func() { r.done <- launcher.Up(ctx, cfg) }()
		mastertest.WaitFor(t, 3*time.Minute, "cube up", func() bool {
			select {
			case err := <-r.done:
				t.Fatalf("cube up returned early: %v", err)
			default:
			}
			return strings.Contains(out.String()[mark:], "cube is up")
		})
		return r
	}
	down := func(r running) {
		r.cancel()
		select {
		case err := <-r.done:
			if err != nil {
				t.Fatalf("cube up: %v", err)
			}
		case <-time.After(time.Minute):
			t.Fatal("cube up did not stop")
		}
	}
	env := func() map[string]string {
		vars, err := launcher.Env(cfg)
		if err != nil {
			t.Fatal(err)
		}
		m := map[string]string{}
		for _, v := range vars {
			m[v.Name] = v.Value
		}
		return m
	}

	first := up()
	e := env()
	if e["E2B_API_URL"] != "http://"+cfg.APIAddr || e["E2B_SANDBOX_URL"] != "http://"+cfg.ProxyAddr ||
		!strings.HasPrefix(e["E2B_API_KEY"], "e2b_") || !strings.Contains(out.String(), "E2B_API_KEY="+e["E2B_API_KEY"]) {
		t.Fatalf("environment: %v\n%s", e, out.String())
	}
	checkTLS(t, cfg, nodeAPI, cubeletTCP)
	checkListeners(t, cfg, nodeAPI, cubeletTCP)
	// A second launcher does not start anything.
	if err := launcher.Up(context.Background(), cfg); !errors.Is(err, launcher.ErrAlreadyRunning) {
		t.Fatalf("second cube up: %v", err)
	}
	api := &mastertest.Client{Base: e["E2B_API_URL"], Key: e["E2B_API_KEY"], HC: &http.Client{Timeout: time.Minute}}
	health := func(sandboxID string) int {
		req, _ := http.NewRequest("GET", e["E2B_SANDBOX_URL"]+"/health", nil)
		req.Header.Set("E2b-Sandbox-Id", sandboxID)
		req.Header.Set("E2b-Sandbox-Port", "49983")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0
		}
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusNoContent {
			t.Logf("health %s: %d %s", sandboxID, resp.StatusCode, b)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	var sb struct{ SandboxID string }
	if r := api.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "base"}, &sb); r.StatusCode != 201 {
		t.Fatalf("create: %d %s", r.StatusCode, r.Body)
	}
	if code := health(sb.SandboxID); code != http.StatusNoContent {
		t.Fatalf("route: %d", code)
	}
	if n, _ := strconv.Atoi(os.Getenv("CUBE_UP_LATENCY")); n > 0 {
		measure(t, api, health, n)
	}
	down(first)

	second := up()
	defer down(second)
	if got := env()["E2B_API_KEY"]; got != e["E2B_API_KEY"] {
		t.Fatalf("the key changed across restarts: %s -> %s", e["E2B_API_KEY"], got)
	}
	var list []struct{ SandboxID, State string }
	api.Do(t, "GET", "/v2/sandboxes", nil, &list)
	if len(list) != 1 || list[0].SandboxID != sb.SandboxID || list[0].State != "running" {
		t.Fatalf("after restart: %+v", list)
	}
	if code := health(sb.SandboxID); code != http.StatusNoContent {
		t.Fatalf("route after restart: %d", code)
	}
	if r := api.Do(t, "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil); r.StatusCode != 204 {
		t.Fatalf("kill: %d %s", r.StatusCode, r.Body)
	}
	leakcheck.AssertNone(t, context.Background(), scope)
}

// measure is the closing-note figure when the SDK path is not available:
// create through the E2B API, then poll the agent's /health through the
// route until it answers; n rounds, median and p90.
func measure(t *testing.T, api *mastertest.Client, health func(string) int, n int) {
	var ds []time.Duration
	for range n {
		start := time.Now()
		var sb struct{ SandboxID string }
		if r := api.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "base"}, &sb); r.StatusCode != 201 {
			t.Fatalf("create: %d %s", r.StatusCode, r.Body)
		}
		for health(sb.SandboxID) != http.StatusNoContent {
			time.Sleep(time.Millisecond)
		}
		ds = append(ds, time.Since(start))
		api.Do(t, "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil)
	}
	sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
	res, _ := json.Marshal(map[string]string{"n": fmt.Sprint(n), "median": ds[n/2].String(), "p90": ds[n*9/10].String(), "min": ds[0].String()})
	t.Logf("create -> first /health through the route: %s", res)
}

// checkTLS: cube up made the cluster CA (key 0600) and serves the TCP
// listeners of master and node with mutual TLS: a plaintext caller and a
// TLS caller without a certificate are refused on cubelet's api.tcp and
// cubemaster's api.node; the operator certificate it issued (role admin)
// is served by cubelet (the control).
func checkTLS(t *testing.T, cfg launcher.Config, nodeAPI, cubeletTCP string) {
	t.Helper()
	dir := filepath.Join(cfg.StateDir, "pki")
	if fi, err := os.Stat(filepath.Join(dir, "ca.key")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("CA key: %v, %v: want a 0600 file", fi, err)
	}
	admin := serve.TLSFiles{Cert: filepath.Join(dir, "admin.crt"), Key: filepath.Join(dir, "admin.key"), CA: filepath.Join(dir, "ca.crt")}
	tc, err := admin.Client("tls")
	if err != nil {
		t.Fatal(err)
	}
	noCert := tc.Clone()
	noCert.Certificates = nil
	health := func(tc *tls.Config) error {
		conn, err := cubeletclient.DialTLS(cubeletTCP, tc)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err = cubeletclient.New(conn).Health(ctx, &cubeletpb.HealthRequest{})
		return err
	}
	for name, c := range map[string]*tls.Config{"plaintext": nil, "TLS without a certificate": noCert} {
		if err := health(c); err == nil {
			t.Fatalf("cubelet api.tcp served a %s caller", name)
		} else {
			t.Logf("cubelet api.tcp, %s caller: %v", name, err)
		}
		conn, err := grpc.NewClient(nodeAPI, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if c != nil {
			conn, err = grpc.NewClient(nodeAPI, grpc.WithTransportCredentials(credentials.NewTLS(c)))
		}
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err = masterpb.NewNodeServiceClient(conn).Register(ctx, &masterpb.RegisterRequest{Node: &masterpb.NodeReport{NodeId: "rogue", Address: "127.0.0.1:1"}})
		cancel()
		conn.Close()
		if status.Code(err) != codes.Unavailable {
			t.Fatalf("cubemaster api.node, %s caller: %v, want Unavailable (no handshake)", name, err)
		}
		t.Logf("cubemaster api.node, %s caller: %v", name, err)
	}
	if err := health(tc); err != nil {
		t.Fatalf("control: cubelet api.tcp with cube up's admin certificate: %v", err)
	}
	t.Log("control: cube up's admin certificate is served by cubelet api.tcp")
}
