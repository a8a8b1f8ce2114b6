// Package nettest runs network-agent for tests: an agent (in-process or as
// a process) on private directories, a random node CIDR and a private link
// prefix, a "world" namespace that plays the internet, and probes that
// connect from inside a namespace. Traffic only ever flows between
// namespaces a test created: the world's addresses are routed explicitly
// to its veth, so the host's default route is never used.
package nettest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"math/big"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/leakcheck"
	"github.com/cubesandbox/cube/internal/network/agent"
	"github.com/cubesandbox/cube/internal/network/agentapi"
	"github.com/cubesandbox/cube/internal/serve"
	"github.com/cubesandbox/cube/internal/testenv"
)

// RequireRoot skips t unless it runs as root (namespaces, links, nftables).
func RequireRoot(t testing.TB) {
	t.Helper()
	testenv.RequireRoot(t, "network namespaces, links and nftables")
}

// OfflineDNS is the DNS upstream of test agents that name none: host
// loopback's discard port, where nothing listens, so a forwarded query
// fails at once and never leaves the machine.
const OfflineDNS = "127.0.0.1:9"

// Options shape a test agent.
type Options struct {
	PoolSize, VMPoolSize int
	RefillPerSecond      float64 // default 200
	// CIDRBits is the node CIDR's prefix length (default 20: 1024 slots).
	CIDRBits int
	// Serve starts the gRPC API on Env.Socket.
	Serve bool
	// OpenPrivate is the agent's [policy] open_private.
	OpenPrivate []string
	// DNSUpstreams is the agent's [dns] upstreams (World.ServeDNS);
	// empty: OfflineDNS, so that no test forwards a sandbox's query to
	// the host's resolvers (off the machine).
	DNSUpstreams []string
	// DNSRate and DNSBurst are the per-sandbox query limit (default: the
	// embedded defaults).
	DNSRate  float64
	DNSBurst int
	// NoDNS turns the forwarder off ([dns] enabled = false), and the
	// egress proxy with it.
	NoDNS bool
	// NoEgress turns the egress proxy off ([egress] enabled = false).
	NoEgress bool
	// UpstreamCA is the proxy's [egress] upstream_ca (TestCA.File).
	UpstreamCA string
	// EgressCADir is the proxy's [egress] ca_dir ("" = the default under
	// the agent's data dir, where it makes its own).
	EgressCADir string
}

// Env is one test agent's world: config, directories and the agent.
type Env struct {
	Dir    string
	Config *agent.Config
	Agent  *agent.Agent
	Socket string
	log    *slog.Logger
	stop   context.CancelFunc
	// started: an agent ran on this state, so cleanup must purge it.
	started bool
	served  chan struct{}
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func randInt(n int64) int64 {
	v, _ := rand.Int(rand.Reader, big.NewInt(n))
	return v.Int64()
}

// NewConfig returns a private agent config (nothing started).
func NewConfig(t testing.TB, o Options) (*agent.Config, string) {
	t.Helper()
	RequireRoot(t)
	id := randHex(2)
	dir := filepath.Join(os.TempDir(), "cube-net-"+id)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	bits := o.CIDRBits
	if bits == 0 {
		bits = 20
	}
	c := agent.Defaults()
	c.Prefix = "nt" + id
	c.RunDir = filepath.Join(dir, "run")
	c.DataDir = filepath.Join(dir, "data")
	c.NodeCIDR = randomCIDR(bits)
	c.API.Socket = filepath.Join(dir, "agent.sock")
	c.API.HTTP = ""
	c.Pool.Size, c.Pool.VMSize = o.PoolSize, o.VMPoolSize
	c.Policy.OpenPrivate = o.OpenPrivate
	c.DNS.Upstreams = o.DNSUpstreams
	if len(c.DNS.Upstreams) == 0 {
		c.DNS.Upstreams = []string{OfflineDNS}
	}
	c.DNS.Enabled = !o.NoDNS
	c.Egress.Enabled = !o.NoDNS && !o.NoEgress
	c.Egress.UpstreamCA = o.UpstreamCA
	c.Egress.CADir = o.EgressCADir
	if o.DNSRate > 0 {
		c.DNS.Rate, c.DNS.Burst = o.DNSRate, o.DNSBurst
	}
	c.Pool.RefillPerSecond = o.RefillPerSecond
	if c.Pool.RefillPerSecond == 0 {
		c.Pool.RefillPerSecond = 200
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	return c, dir
}

// randomCIDR picks a block in 10.192.0.0/10 so concurrent test processes
// rarely collide; the agent refuses an overlap and Start retries.
func randomCIDR(bits int) string {
	size := int64(1) << (32 - bits)
	n := (int64(1) << 22) / size // blocks in a /10
	v := uint32(10)<<24 | uint32(192)<<16 | uint32(randInt(n)*size)
	return netip.PrefixFrom(netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)}), bits).String()
}

// Start runs an agent in-process. Its cleanup checks that the test
// released every slot, purges the pool, and fails the test on leaks.
func Start(t testing.TB, o Options) *Env {
	t.Helper()
	cfg, dir := NewConfig(t, o)
	e := &Env{Dir: dir, Config: cfg, Socket: cfg.API.Socket, log: testLogger(t)}
	t.Cleanup(func() { e.teardown(t) })
	var err error
	for try := 0; try < 5; try++ {
		if e.Agent, err = agent.New(context.Background(), cfg, e.log); err == nil || !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "overlaps") {
			break
		}
		cfg.NodeCIDR = randomCIDR(cfg.CIDR().Bits()) // another block
		if verr := cfg.Validate(); verr != nil {
			t.Fatal(verr)
		}
	}
	if err != nil {
		t.Fatalf("start network-agent: %v", err)
	}
	e.started = true
	if o.Serve {
		e.serve()
	}
	return e
}

func (e *Env) serve() {
	ctx, cancel := context.WithCancel(context.Background())
	e.stop = cancel
	e.served = make(chan struct{})
	go func() {
		defer close(e.served)
		_ = agentapi.Serve(ctx, e.Agent, e.log)
	}()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		if serve.Accepting(e.Socket) {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Stop stops serving and closes the agent, leaving its slots (as a crash
// or an upgrade would).
func (e *Env) Stop(t testing.TB) {
	t.Helper()
	if e.stop != nil {
		e.stop()
		<-e.served
		e.stop = nil
	}
	if e.Agent != nil {
		if err := e.Agent.Close(); err != nil {
			t.Errorf("close agent: %v", err)
		}
		e.Agent = nil
	}
}

// Restart stops the agent and starts a new one on the same state.
func (e *Env) Restart(t testing.TB, serve bool) {
	t.Helper()
	e.Stop(t)
	a, err := agent.New(context.Background(), e.Config, e.log)
	if err != nil {
		t.Fatalf("restart network-agent: %v", err)
	}
	e.Agent = a
	if serve {
		e.serve()
	}
}

// Scope is what the leak checker inspects for this agent.
func (e *Env) Scope() leakcheck.Scope {
	return leakcheck.Scope{RunDir: e.Config.RunDir, DataDir: e.Config.DataDir,
		NetPrefix: e.Config.Prefix, NetnsDir: e.Config.NetnsDir()}
}

// AssertNoLeaks fails t if anything of this agent is left on the host.
func (e *Env) AssertNoLeaks(t testing.TB) {
	t.Helper()
	leakcheck.AssertNone(t, context.Background(), e.Scope())
}

func (e *Env) teardown(t testing.TB) {
	ctx := context.Background()
	if e.Agent == nil && e.started {
		// Stopped (or killed) by the test: a fresh agent purges the state.
		a, err := agent.New(ctx, e.Config, e.log)
		if err != nil {
			t.Errorf("reopen agent for cleanup: %v", err)
		}
		e.Agent = a
	}
	if e.Agent != nil {
		if left := e.Agent.List(ctx); len(left) > 0 && !t.Failed() {
			var ids []string
			for _, n := range left {
				ids = append(ids, n.SandboxID)
			}
			t.Errorf("slots still assigned after the test: %v", ids)
		}
		if err := e.Agent.Purge(ctx); err != nil {
			t.Errorf("purge: %v", err)
		}
	}
	e.Stop(t)
	e.AssertNoLeaks(t)
	_ = os.RemoveAll(e.Dir)
}

func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelInfo}))
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// AssertNoSlots fails t if any slot's kernel objects (links, pinned
// namespaces) are left, while the agent still runs (its host table may
// stay).
func (e *Env) AssertNoSlots(t testing.TB) {
	t.Helper()
	leaks, err := leakcheck.Check(context.Background(), e.Scope())
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range leaks {
		if l.Kind == leakcheck.KindNft && l.What == "host table "+e.Config.Prefix {
			continue
		}
		t.Errorf("leak: %s", l)
	}
}
