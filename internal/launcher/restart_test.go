package launcher_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/cubeletclient"
	"github.com/cubesandbox/cube/internal/launcher"
	"github.com/cubesandbox/cube/internal/leakcheck"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/network/agent"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/storage"
	"github.com/cubesandbox/cube/internal/testbin"
	"github.com/cubesandbox/cube/internal/testimage"
)

// TestRestartNoErrors: four clients create and kill sandboxes in a loop
// through the E2B API of a real `cube up` (network-agent included) while
// the test SIGKILLs cubelet, then network-agent; cube up restarts each
// within about a second. No client sees an error: creates placed while
// a daemon is down wait for it (nodes.restart_wait) instead of failing.
// Afterwards the node holds no sandbox a client does not know of (every
// one the clients made was killed). Latency p50/p99 before and during
// each restart are logged.
func TestRestartNoErrors(t *testing.T) {
	cubelettest.RequireRoot(t)
	bin := binaries(t)
	if err := os.Link(testbin.Build(t, "network-agent", ""), filepath.Join(bin, "network-agent")); err != nil {
		t.Fatal(err)
	}
	layout, err := testimage.Busybox(context.Background(), filepath.Join(os.TempDir(), "cube-test-busybox"))
	if err != nil {
		t.Fatal(err)
	}
	root, err := os.MkdirTemp("", "cube-restart-")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(root, 0o711); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	id := hex.EncodeToString(b)
	prefix := "rs" + id[:6]
	// A random /24 in 10.192.0.0/10, as the other network tests pick
	// theirs: the agent refuses a range another one on this host uses.
	v, _ := rand.Int(rand.Reader, big.NewInt(1<<14))
	a := uint32(10)<<24 | uint32(192)<<16 | uint32(v.Int64()<<8)
	cidr := netip.PrefixFrom(netip.AddrFrom4([4]byte{byte(a >> 24), byte(a >> 16), byte(a >> 8), 0}), 24)
	out := &syncBuffer{}
	cfg := launcher.Config{
		StateDir: filepath.Join(root, "state"), RunDir: filepath.Join(root, "run"), LogDir: filepath.Join(root, "log"),
		BinDir: bin, APIAddr: freePort(t), ProxyAddr: freePort(t), Template: "busybox", TemplateSource: layout,
		ExtraMasterTOML: "[api]\nnode = \"\"\n[nodes]\nheartbeat_interval = \"200ms\"\nunhealthy_after = \"3s\"\n",
		ExtraCubeletTOML: fmt.Sprintf("[node]\nid = \"rs-%[1]s\"\ncgroup_parent = \"cube-test-%[1]s\"\n[api]\ntcp = \"\"\nmetrics = \"\"\n"+
			"[storage]\npool_image_size_mib = 4096\ntemplate_headroom_mib = 32\n[gc]\ninterval = \"200ms\"\n", id),
		ExtraNetworkTOML: fmt.Sprintf("node_cidr = %q\nprefix = %q\n[api]\nhttp = \"\"\n[pool]\nsize = 4\n[dns]\nupstreams = [%q]\n", cidr, prefix, nettest.OfflineDNS),
		Out:              out, Log: mastertest.Log(t),
	}
	scope := leakcheck.Scope{
		DataDir: cfg.StateDir, RunDir: cfg.RunDir, RuncRoot: filepath.Join(cfg.RunDir, "runc"), CgroupName: "cube-test-" + id,
		AllowMounts: []string{filepath.Join(cfg.StateDir, "pool")}, AllowLoopBacking: []string{filepath.Join(cfg.StateDir, "pool.img")},
		NetPrefix: prefix, NetnsDir: filepath.Join(cfg.RunDir, "network", "netns"),
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- launcher.Up(ctx, cfg) }()
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("cube up: %v", err)
			}
		case <-time.After(time.Minute):
			t.Error("cube up did not stop")
		}
	}
	t.Cleanup(func() {
		stop()
		purgeNetwork(t, cfg)
		leakcheck.AssertNone(t, context.Background(), scope)
		if p, err := storage.OpenPool(context.Background(), storage.PoolConfig{Dir: filepath.Join(cfg.StateDir, "pool"), ImageSizeBytes: 1 << 30}); err == nil {
			_ = p.Teardown(context.Background())
		}
		os.RemoveAll(root)
	})
	mastertest.WaitFor(t, 3*time.Minute, "cube up", func() bool {
		select {
		case err := <-done:
			t.Fatalf("cube up returned early: %v\n%s", err, out.String())
		default:
		}
		return strings.Contains(out.String(), "cube is up")
	})
	vars, err := launcher.Env(cfg)
	if err != nil {
		t.Fatal(err)
	}
	env := map[string]string{}
	for _, v := range vars {
		env[v.Name] = v.Value
	}
	api := &restartClient{base: env["E2B_API_URL"], key: env["E2B_API_KEY"], hc: &http.Client{Timeout: time.Minute}}

	// Phases: before the first kill, from the kill of cubelet, from the
	// kill of network-agent.
	phases := []string{"steady", "cubelet restart", "network-agent restart"}
	var (
		mu      sync.Mutex
		phase   int
		lat     = map[int][]time.Duration{}
		killLat = map[int][]time.Duration{}
		errs    []string
		known   = map[string]bool{} // sandboxes the clients believe exist
		finish  = make(chan struct{})
	)
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for {
				select {
				case <-finish:
					return
				default:
				}
				start := time.Now()
				code, body, sbID := api.create()
				d := time.Since(start)
				mu.Lock()
				// A create counts in the phase it ended in: one in
				// flight at a kill is one that went through it.
				p := phase
				if code != http.StatusCreated {
					errs = append(errs, fmt.Sprintf("%s: create: %d %s", phases[p], code, body))
					mu.Unlock()
					continue
				}
				lat[p] = append(lat[p], d)
				known[sbID] = true
				mu.Unlock()
				kstart := time.Now()
				code, body = api.kill(sbID)
				kd := time.Since(kstart)
				mu.Lock()
				killLat[phase] = append(killLat[phase], kd)
				mu.Unlock()
				if code != http.StatusNoContent {
					mu.Lock()
					errs = append(errs, fmt.Sprintf("%s: kill %s: %d %s", phases[p], sbID, code, body))
					mu.Unlock()
					continue
				}
				mu.Lock()
				delete(known, sbID)
				mu.Unlock()
			}
		})
	}
	nodeSock := filepath.Join(cfg.RunDir, "cubelet.sock")
	for i, daemon := range []string{"cubelet", "network-agent"} {
		time.Sleep(3 * time.Second)
		pid := daemonPID(t, filepath.Join(bin, daemon))
		mu.Lock()
		phase = i + 1
		mu.Unlock()
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		killed := time.Now()
		mastertest.WaitFor(t, 30*time.Second, daemon+" restarted", func() bool {
			p, ok := findPID(filepath.Join(bin, daemon))
			return ok && p != pid
		})
		t.Logf("SIGKILL %s (pid %d): cube up restarted it in %s", daemon, pid, time.Since(killed).Round(time.Millisecond))
		mastertest.WaitFor(t, 30*time.Second, "a create after the "+daemon+" restart", func() bool {
			mu.Lock()
			defer mu.Unlock()
			return len(lat[phase]) >= 8
		})
	}
	time.Sleep(2 * time.Second)
	close(finish)
	wg.Wait()

	stats := func(ds []time.Duration) string {
		sort.Slice(ds, func(a, b int) bool { return ds[a] < ds[b] })
		return fmt.Sprintf("p50 %s p99 %s max %s", ds[len(ds)/2].Round(time.Millisecond),
			ds[len(ds)*99/100].Round(time.Millisecond), ds[len(ds)-1].Round(time.Millisecond))
	}
	for i, name := range phases {
		if len(lat[i]) == 0 || len(killLat[i]) == 0 {
			t.Errorf("%s: no create or no kill succeeded", name)
			continue
		}
		t.Logf("%-22s %4d creates: %s; %4d kills: %s", name, len(lat[i]), stats(lat[i]), len(killLat[i]), stats(killLat[i]))
	}
	if len(errs) > 0 {
		t.Errorf("%d client error(s), e.g.:\n%s", len(errs), strings.Join(errs[:min(len(errs), 5)], "\n"))
	}
	if len(known) > 0 {
		t.Errorf("sandboxes left that a kill did not remove: %v", known)
	}

	// Nothing a client does not know of: none is left on the node (an
	// undo of a create whose answer was lost may still be on its way)
	// nor in the catalog.
	conn, err := cubeletclient.Dial(nodeSock)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	node := cubeletclient.New(conn)
	var left []string
	mastertest.WaitFor(t, 30*time.Second, "no sandbox left on the node", func() bool {
		resp, err := node.ListSandboxes(context.Background(), &cubeletpb.ListSandboxesRequest{})
		if err != nil {
			return false
		}
		left = nil
		for _, sb := range resp.Sandboxes {
			left = append(left, sb.Id+" "+sb.State.String())
		}
		return len(left) == 0
	})
	if code, body := api.get("/v2/sandboxes"); code != http.StatusOK || strings.TrimSpace(body) != "[]" {
		t.Errorf("E2B list after the run: %d %s", code, body)
	}
}

// daemonPID is the pid of the one running process of binary path.
func daemonPID(t *testing.T, path string) int {
	t.Helper()
	pid, ok := findPID(path)
	if !ok {
		t.Fatalf("no process runs %s", path)
	}
	return pid
}

func findPID(path string) (int, bool) {
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if exe, err := os.Readlink(filepath.Join("/proc", e.Name(), "exe")); err == nil && exe == path {
			return pid, true
		}
	}
	return 0, false
}

// purgeNetwork removes what the stopped network-agent keeps for its next
// start (its pooled slots, its nftables table).
func purgeNetwork(t *testing.T, cfg launcher.Config) {
	data, err := os.ReadFile(filepath.Join(cfg.StateDir, "launcher", "network-agent.toml"))
	if err != nil {
		return
	}
	c, err := agent.ParseConfig(data)
	if err != nil {
		t.Errorf("network-agent config: %v", err)
		return
	}
	a, err := agent.New(context.Background(), c, mastertest.Log(t))
	if err != nil {
		t.Errorf("reopen network-agent for cleanup: %v", err)
		return
	}
	if err := a.Purge(context.Background()); err != nil {
		t.Errorf("purge network-agent: %v", err)
	}
	_ = a.Close()
}

// restartClient calls the E2B API from the clients' goroutines (no
// t.Fatal there): a transport error is a client error like a bad status.
type restartClient struct {
	base, key string
	hc        *http.Client
}

func (c *restartClient) do(method, path string, body any) (int, string) {
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, c.base+path, rd)
	if err != nil {
		return 0, err.Error()
	}
	req.Header.Set("X-API-KEY", c.key)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(data)
}

func (c *restartClient) create() (int, string, string) {
	code, body := c.do("POST", "/v2/sandboxes", map[string]any{"templateID": "base"})
	var sb struct{ SandboxID string }
	_ = json.Unmarshal([]byte(body), &sb)
	return code, body, sb.SandboxID
}

func (c *restartClient) kill(id string) (int, string) { return c.do("DELETE", "/sandboxes/"+id, nil) }

func (c *restartClient) get(path string) (int, string) { return c.do("GET", path, nil) }
