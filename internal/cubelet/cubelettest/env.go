// Package cubelettest sets up real cubelet environments for tests: a
// private data dir (with its own loop-backed XFS pool), run dir, runc root
// and cgroup parent, a statically built cube-agent, and a busybox template
// built locally. Every later suite (storage, network, e2e) reuses it.
package cubelettest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/config"
	"github.com/cubesandbox/cube/internal/leakcheck"
	"github.com/cubesandbox/cube/internal/storage"
	"github.com/cubesandbox/cube/internal/testbin"
	"github.com/cubesandbox/cube/internal/testenv"
	"github.com/cubesandbox/cube/internal/testimage"
)

// RequireRoot skips t unless it runs as root (loop devices, mounts, runc).
func RequireRoot(t testing.TB) {
	t.Helper()
	testenv.RequireRoot(t, "loop devices, mounts, cgroups and runc")
}

// Env is one isolated cubelet environment.
type Env struct {
	Dir      string // root of everything this env creates
	Config   *config.Config
	AgentBin string
	Image    string // busybox OCI layout
	// OwnMounts are filesystems the test mounted as the env's dirs (a
	// small data or run dir for disk-full tests): not leaks.
	OwnMounts []string
}

// RepoRoot is the module root.
func RepoRoot() string { return testbin.Root() }

// Binaries builds cube-agent (static), cubelet and cubecli once per test
// process into one directory and returns it. -tags failpoints: tests
// drive the daemons' faults through CUBE_FAILPOINTS, which release builds
// ignore.
func Binaries(t testing.TB) string {
	t.Helper()
	var dir string
	for _, b := range []string{"cube-agent", "cubelet", "cubecli"} {
		dir = filepath.Dir(testbin.Build(t, b, "failpoints"))
	}
	return dir
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// New makes a fresh environment. Its cleanup (registered on t) tears the
// pool down and fails the test if anything leaked.
func New(t testing.TB, extraTOML string) *Env {
	t.Helper()
	RequireRoot(t)
	bin := Binaries(t)
	id := randHex(4)
	dir := filepath.Join(os.TempDir(), "cube-test-"+id)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	layout, err := testimage.Busybox(context.Background(), filepath.Join(os.TempDir(), "cube-test-busybox"))
	if err != nil {
		t.Fatal(err)
	}
	toml := fmt.Sprintf(`
[node]
id = "test-%[1]s"
data_dir = %[2]q
run_dir = %[3]q
cgroup_parent = "cube-test-%[1]s"
[api]
socket = %[4]q
tcp = ""
metrics = ""
[storage]
pool_image_size_mib = 4096
agent_binary = %[5]q
template_headroom_mib = 32
[gc]
interval = "200ms"
max_backoff = "2s"
`, id, filepath.Join(dir, "data"), filepath.Join(dir, "run"), filepath.Join(dir, "run", "cubelet.sock"), filepath.Join(bin, "cube-agent"))
	cfg, err := config.Parse([]byte(toml + "\n" + extraTOML))
	if err != nil {
		t.Fatalf("config: %v", err)
	}
	e := &Env{Dir: dir, Config: cfg, AgentBin: filepath.Join(bin, "cube-agent"), Image: layout}
	t.Cleanup(func() { e.teardown(t) })
	return e
}

// WriteConfig writes the env's config as a TOML file a cubelet process
// can load, plus extra TOML appended, and returns its path.
func (e *Env) WriteConfig(t testing.TB, extra string) string {
	t.Helper()
	c := e.Config
	body := fmt.Sprintf(`
[node]
id = %q
data_dir = %q
run_dir = %q
cgroup_parent = %q
[api]
socket = %q
tcp = ""
metrics = ""
[storage]
pool_image_size_mib = %d
agent_binary = %q
template_headroom_mib = %d
[gc]
interval = "200ms"
max_backoff = "2s"
%s
`, c.Node.ID, c.Node.DataDir, c.Node.RunDir, c.Node.CgroupParent, c.API.Socket,
		c.Storage.PoolImageSizeMiB, c.Storage.AgentBinary, c.Storage.TemplateHeadroomMiB, extra)
	p := filepath.Join(e.Dir, "cubelet.toml")
	if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// Scope is what the leak checker inspects for this env.
func (e *Env) Scope() leakcheck.Scope {
	c := e.Config
	return leakcheck.Scope{
		DataDir:          c.Node.DataDir,
		RunDir:           c.Node.RunDir,
		RuncRoot:         c.Runc.Root,
		RunscRoot:        c.Gvisor.Root,
		VMRoot:           c.VM.Root,
		CgroupName:       c.Node.CgroupParent,
		AllowMounts:      append([]string{c.PoolDir()}, e.OwnMounts...),
		AllowLoopBacking: []string{c.PoolDir() + ".img"},
	}
}

// AssertNoLeaks fails t if anything a sandbox held is still on the node.
func (e *Env) AssertNoLeaks(t testing.TB) {
	t.Helper()
	leakcheck.AssertNone(t, context.Background(), e.Scope())
}

// Start runs a cubelet in-process on this env; it is closed on cleanup.
func (e *Env) Start(t testing.TB) *cubelet.Service {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	svc, err := cubelet.New(ctx, e.Config, slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelInfo})))
	if err != nil {
		t.Fatalf("start cubelet: %v", err)
	}
	t.Cleanup(func() { svc.Close() })
	return svc
}

// ImportBusybox imports the busybox test image as template id.
func (e *Env) ImportBusybox(t testing.TB, svc *cubelet.Service, id string) {
	t.Helper()
	if _, err := svc.ImportTemplate(context.Background(), id, e.Image, nil); err != nil {
		t.Fatalf("import template: %v", err)
	}
}

// teardown destroys whatever sandboxes a failed test left (so one failure
// does not cascade into leaked loop devices on the machine), checks for
// leaks first so a leak is still reported, then removes the pool.
func (e *Env) teardown(t testing.TB) {
	ctx := context.Background()
	leaks, _ := leakcheck.Check(ctx, e.Scope())
	if len(leaks) > 0 && !t.Failed() {
		var b strings.Builder
		for _, l := range leaks {
			b.WriteString("\n  " + l.String())
		}
		t.Errorf("leaks after test:%s", b.String())
	}
	forceClean(ctx, e)
	if p, err := storage.OpenPool(ctx, storage.PoolConfig{Dir: e.Config.PoolDir(), ImageSizeBytes: 1 << 30}); err == nil {
		_ = p.Teardown(ctx)
	}
	_ = os.RemoveAll(e.Dir)
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
