package chaos

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/cubeletclient"
	"github.com/cubesandbox/cube/internal/launcher"
	"github.com/cubesandbox/cube/internal/leakcheck"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/storage"
	"github.com/cubesandbox/cube/internal/testbin"
	"github.com/cubesandbox/cube/internal/testenv"
	"github.com/cubesandbox/cube/internal/testimage"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// daemons are what `cube up` supervises and the chaos driver kills.
var daemons = []string{"cubelet", "network-agent", "cubemaster"}

// binaries builds the four daemons' binaries once per test process into
// one directory (internal/testbin; failpoints tag, which the soak does
// not arm).
func binaries(t *testing.T) string {
	t.Helper()
	var dir string
	for _, b := range []string{"cubelet", "cube-agent", "cubemaster", "network-agent"} {
		dir = filepath.Dir(testbin.Build(t, b, "failpoints"))
	}
	return dir
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// system is a running `cube up` (launcher.Up in this process) with a
// network-agent, on private directories, ports, cgroup parent, link
// prefix and node CIDR.
type system struct {
	t       *testing.T
	cfg     launcher.Config
	bin     string
	runtime string
	scope   leakcheck.Scope
	api     string // E2B_API_URL
	route   string // E2B_SANDBOX_URL
	key     string
	node    cubeletpb.CubeletServiceClient
	admin   masterpb.AdminServiceClient
	cancel  context.CancelFunc
	done    chan error
	out     *syncBuffer
	closers []func() error // the clients' connections, closed at cleanup
}

type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
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

// randomCIDR is a /24 in 10.192.0.0/10, as the other suites pick theirs:
// network-agent refuses one that overlaps another node's on this host.
func randomCIDR() string {
	v, _ := rand.Int(rand.Reader, big.NewInt(1<<14))
	a := uint32(10)<<24 | uint32(192)<<16 | uint32(v.Int64()<<8)
	return netip.PrefixFrom(netip.AddrFrom4([4]byte{byte(a >> 24), byte(a >> 16), byte(a >> 8), byte(a)}), 24).String()
}

// startSystem runs cube up with runtime as the node's default runtime and
// waits until it serves. Its cleanup stops it, purges network-agent's
// slots, tears the pool down and fails the test on a leak.
func startSystem(t *testing.T, runtime string) *system {
	t.Helper()
	cubelettest.RequireRoot(t)
	testenv.RequireBinary(t, "runc", "runc")
	testenv.RequireBinary(t, "nft", "nftables")
	if runtime == "gvisor" {
		testenv.RequireBinary(t, "runsc", "runsc")
	}
	bin := binaries(t)
	layout, err := testimage.Busybox(context.Background(), filepath.Join(os.TempDir(), "cube-test-busybox"))
	if err != nil {
		t.Fatal(err)
	}
	id := randHex(4)
	root := filepath.Join(os.TempDir(), "cube-chaos-"+id)
	// Searchable (not listable) like /run: a runc sandbox's mapped root
	// must reach its idmapped root filesystem under the run dir.
	if err := os.MkdirAll(root, 0o711); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(root, 0o711); err != nil {
		t.Fatal(err)
	}
	prefix := "ch" + id[:6]
	s := &system{t: t, bin: bin, runtime: runtime, out: &syncBuffer{}}
	nodeAPI := freePort(t)
	s.cfg = launcher.Config{
		StateDir: filepath.Join(root, "state"), RunDir: filepath.Join(root, "run"), LogDir: filepath.Join(root, "log"),
		BinDir: bin, APIAddr: freePort(t), ProxyAddr: freePort(t), Template: "busybox", TemplateSource: layout,
		ExtraMasterTOML: fmt.Sprintf("[api]\nnode = %q\n[nodes]\nheartbeat_interval = \"200ms\"\nunhealthy_after = \"3s\"\n"+
			"[sandbox]\ncreate_timeout = \"2m\"\n", nodeAPI),
		ExtraCubeletTOML: fmt.Sprintf("[node]\nid = \"chaos-%[1]s\"\ncgroup_parent = \"cube-chaos-%[1]s\"\ndefault_runtime = %[2]q\n"+
			"[api]\ntcp = \"\"\nmetrics = \"\"\n[storage]\npool_image_size_mib = 4096\ntemplate_headroom_mib = 32\n[gc]\ninterval = \"200ms\"\n",
			id, runtime),
		ExtraNetworkTOML: fmt.Sprintf("node_cidr = %q\nprefix = %q\n[api]\nhttp = \"\"\n[pool]\nsize = 4\nvm_size = 0\n", randomCIDR(), prefix),
		Out:              s.out, Log: mastertest.Log(t),
	}
	s.scope = leakcheck.Scope{
		DataDir: s.cfg.StateDir, RunDir: s.cfg.RunDir, RuncRoot: filepath.Join(s.cfg.RunDir, "runc"), CgroupName: "cube-chaos-" + id,
		AllowMounts: []string{filepath.Join(s.cfg.StateDir, "pool")}, AllowLoopBacking: []string{filepath.Join(s.cfg.StateDir, "pool.img")},
		NetPrefix: prefix, NetnsDir: filepath.Join(s.cfg.RunDir, "network", "netns"),
		RunscRoot: filepath.Join(s.cfg.RunDir, "runsc"), VMRoot: filepath.Join(s.cfg.RunDir, "vm"),
	}
	t.Cleanup(func() {
		// A failed run leaves what it made: kill it through the API
		// while the system runs (the leak checker still reports what
		// this does not remove).
		if t.Failed() && s.api != "" {
			s.killAll()
		}
		s.stop()
		for _, c := range s.closers {
			_ = c()
		}
		// cube up leaves network-agent's slots for its next start, as it
		// leaves sandboxes: this run's go with it.
		out, err := exec.Command(filepath.Join(bin, "network-agent"), "--config",
			filepath.Join(s.cfg.StateDir, "launcher", "network-agent.toml"), "--purge").CombinedOutput()
		if err != nil {
			t.Errorf("network-agent --purge: %v\n%s", err, out)
		}
		if t.Failed() {
			keep := root + "-logs"
			if err := exec.Command("cp", "-a", s.cfg.LogDir, keep).Run(); err == nil {
				t.Logf("daemon logs kept in %s", keep)
			}
		}
		leakcheck.AssertNone(t, context.Background(), s.scope)
		if p, err := storage.OpenPool(context.Background(), storage.PoolConfig{Dir: filepath.Join(s.cfg.StateDir, "pool"), ImageSizeBytes: 1 << 30}); err == nil {
			_ = p.Teardown(context.Background())
		}
		os.RemoveAll(root)
	})

	ctx, cancel := context.WithCancel(context.Background())
	s.cancel, s.done = cancel, make(chan error, 1)
	go func() { s.done <- launcher.Up(ctx, s.cfg) }()
	mastertest.WaitFor(t, 5*time.Minute, "cube up", func() bool {
		select {
		case err := <-s.done:
			s.done <- err
			t.Fatalf("cube up returned early: %v\n%s", err, s.out.String())
		default:
		}
		return strings.Contains(s.out.String(), "cube is up")
	})
	vars, err := launcher.Env(s.cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range vars {
		switch v.Name {
		case "E2B_API_URL":
			s.api = v.Value
		case "E2B_SANDBOX_URL":
			s.route = v.Value
		case "E2B_API_KEY":
			s.key = v.Value
		}
	}
	conn, err := cubeletclient.Dial(filepath.Join(s.cfg.RunDir, "cubelet.sock"))
	if err != nil {
		t.Fatal(err)
	}
	s.closers = append(s.closers, conn.Close)
	s.node = cubeletclient.New(conn)
	mconn, err := grpc.NewClient("unix://"+filepath.Join(s.cfg.RunDir, "cubemaster.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	s.closers = append(s.closers, mconn.Close)
	s.admin = masterpb.NewAdminServiceClient(mconn)
	return s
}

// stop ends cube up (sandboxes keep running). Idempotent.
func (s *system) stop() {
	if s.cancel == nil {
		return
	}
	s.cancel()
	s.cancel = nil
	select {
	case err := <-s.done:
		if err != nil {
			s.t.Errorf("cube up: %v", err)
		}
	case <-time.After(2 * time.Minute):
		s.t.Error("cube up did not stop")
	}
}

// pid finds the running process of one of the system's daemons by its
// executable (the binaries live in this test's own directory, so no other
// process matches); 0 when none runs.
func (s *system) pid(name string) int {
	want := filepath.Join(s.bin, name)
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		n, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if exe, err := os.Readlink(filepath.Join("/proc", e.Name(), "exe")); err == nil && exe == want {
			if st, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat")); err == nil && zombie(st) {
				continue
			}
			return n
		}
	}
	return 0
}

// zombie: /proc/<pid>/stat's state field (after the parenthesised name).
func zombie(stat []byte) bool {
	s := string(stat)
	i := strings.LastIndexByte(s, ')')
	return i >= 0 && i+2 < len(s) && s[i+2] == 'Z'
}

// kill SIGKILLs daemon name and returns its pid.
func (s *system) kill(name string) (int, error) {
	pid := s.pid(name)
	if pid == 0 {
		return 0, fmt.Errorf("%s is not running", name)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		return 0, fmt.Errorf("kill %s (%d): %w", name, pid, err)
	}
	return pid, nil
}

// serving reports whether daemon name answers on its socket or port.
func (s *system) serving(ctx context.Context, name string) bool {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	switch name {
	case "cubelet":
		_, err := s.node.Health(ctx, &cubeletpb.HealthRequest{})
		return err == nil
	case "cubemaster":
		req, _ := http.NewRequestWithContext(ctx, "GET", s.api+"/health", nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return false
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode == 200
	default:
		var d net.Dialer
		c, err := d.DialContext(ctx, "unix", filepath.Join(s.cfg.RunDir, "network-agent.sock"))
		if err != nil {
			return false
		}
		c.Close()
		return true
	}
}

// nodeHealthy: the master sees the node registered and healthy.
func (s *system) nodeHealthy(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	resp, err := s.admin.ListNodes(ctx, &masterpb.ListNodesRequest{})
	if err != nil {
		return false
	}
	for _, n := range resp.Nodes {
		if n.Healthy {
			return true
		}
	}
	return false
}

// waitUp waits until every daemon serves and the node is healthy in the
// master, and returns how long that took.
func (s *system) waitUp(ctx context.Context, limit time.Duration) (time.Duration, error) {
	begin := time.Now()
	for {
		ok := s.nodeHealthy(ctx)
		for _, d := range daemons {
			ok = ok && s.pid(d) != 0 && s.serving(ctx, d)
		}
		if ok {
			return time.Since(begin), nil
		}
		if time.Since(begin) > limit {
			return 0, fmt.Errorf("the system is not back after %s", limit)
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// killAll deletes every sandbox and snapshot through the E2B API (the
// cleanup of a failed run), waiting up to a minute for the node to empty.
func (s *system) killAll() {
	c := &client{s: s, hc: &http.Client{Timeout: time.Minute}}
	deadline := time.Now().Add(time.Minute)
	for time.Now().Before(deadline) {
		if _, err := s.waitUp(context.Background(), 30*time.Second); err != nil {
			s.t.Logf("cleanup: %v", err)
		}
		v, err := s.look(c)
		if err != nil {
			s.t.Logf("cleanup: %v", err)
			time.Sleep(time.Second)
			continue
		}
		if len(v.api)+len(v.node)+len(v.snaps)+v.nodeSnap == 0 {
			return
		}
		ids := sortedKeys(v.api)
		for id := range v.node {
			if _, ok := v.api[id]; !ok {
				ids = append(ids, id)
			}
		}
		for _, id := range ids {
			_, _, _ = c.api("DELETE", "/sandboxes/"+id, nil)
		}
		for id := range v.snaps {
			_, _, _ = c.api("DELETE", "/templates/"+id, nil)
		}
		for _, id := range v.onlyNode {
			_, _ = s.node.DeleteSnapshot(context.Background(), &cubeletpb.DeleteSnapshotRequest{SnapshotId: id})
		}
		time.Sleep(time.Second)
	}
	s.t.Log("cleanup: the system still holds sandboxes or snapshots after a minute")
}
