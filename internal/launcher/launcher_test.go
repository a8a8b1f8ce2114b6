package launcher_test

import (
	"bytes"
	"context"
	"crypto/rand"
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

	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/launcher"
	"github.com/cubesandbox/cube/internal/leakcheck"
	"github.com/cubesandbox/cube/internal/master/mastertest"
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
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	id := hex.EncodeToString(b)
	out := &syncBuffer{}
	cfg := launcher.Config{
		StateDir: filepath.Join(root, "state"), RunDir: filepath.Join(root, "run"), LogDir: filepath.Join(root, "log"),
		BinDir: bin, APIAddr: freePort(t), ProxyAddr: freePort(t), Template: "busybox", TemplateSource: layout,
		ExtraMasterTOML: "[api]\nnode = \"\"\n[nodes]\nheartbeat_interval = \"200ms\"\nunhealthy_after = \"3s\"\n",
		ExtraCubeletTOML: fmt.Sprintf("[node]\nid = \"up-%[1]s\"\ncgroup_parent = \"cube-test-%[1]s\"\n[api]\ntcp = \"\"\nmetrics = \"\"\n"+
			"[storage]\npool_image_size_mib = 4096\ntemplate_headroom_mib = 32\n[gc]\ninterval = \"200ms\"\n", id),
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
