package scheduler_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/scheduler"
)

func node(id string, mod ...func(*scheduler.Node)) *scheduler.Node {
	n := &scheduler.Node{
		ID: id, Healthy: true, Schedulable: true, Runtimes: []string{"runc"},
		Templates: map[string]bool{"busybox": true}, MilliCPU: 4000, MemoryMiB: 8192,
		TemplateSandboxes: map[string]int{},
	}
	for _, m := range mod {
		m(n)
	}
	return n
}

var req = scheduler.Request{TemplateID: "busybox", MilliCPU: 1000, MemoryMiB: 512}

// testConfig is the default with round overcommit factors the cases
// below compute with.
func testConfig() scheduler.Config {
	c := scheduler.DefaultConfig()
	c.CPUOvercommit, c.MemoryOvercommit = 4, 1
	return c
}

func newSched() *scheduler.Scheduler {
	return scheduler.New(testConfig()).WithRand(rand.New(rand.NewPCG(1, 2)))
}

func TestFilter(t *testing.T) {
	nodes := []*scheduler.Node{
		node("ok"),
		node("sick", func(n *scheduler.Node) { n.Healthy = false }),
		node("cordoned", func(n *scheduler.Node) { n.Schedulable = false }),
		node("notemplate", func(n *scheduler.Node) { n.Templates = map[string]bool{} }),
		node("memfull", func(n *scheduler.Node) { n.AllocMemoryMiB = 8000 }),
		node("cpufull", func(n *scheduler.Node) { n.AllocMilliCPU = 15500 }), // 4 cores x4 overcommit = 16000
		node("small", func(n *scheduler.Node) { n.MaxMemoryMiB = 256 }),
		node("gvisor", func(n *scheduler.Node) { n.Runtimes = []string{"gvisor"} }),
	}
	r := req
	r.Runtime = "runc"
	cands, rejs := newSched().Rank(nodes, r)
	if len(cands) != 1 || cands[0].Node.ID != "ok" {
		t.Fatalf("candidates: %+v", cands)
	}
	reasons := map[string]string{}
	for _, rj := range rejs {
		reasons[rj.NodeID] = rj.Reason
	}
	for id, want := range map[string]string{
		"sick": "unhealthy", "cordoned": "cordoned", "notemplate": `no template "busybox"`,
		"memfull": "memory full: 8000+512 of 8192 MiB", "cpufull": "CPU full: 15500+1000 of 16000 milli-CPU",
		"small": "512 MiB exceeds the node's per-sandbox maximum 256", "gvisor": `no runtime "runc" (has gvisor)`,
	} {
		if reasons[id] != want {
			t.Errorf("%s: reason %q, want %q", id, reasons[id], want)
		}
	}
	// Without a runtime in the request, the gvisor node qualifies.
	if cands, _ := newSched().Rank(nodes, req); len(cands) != 2 {
		t.Errorf("any runtime: %d candidates", len(cands))
	}
	cfg := testConfig()
	cfg.MaxSandboxesPerNode = 3
	if cands, _ := scheduler.New(cfg).Rank([]*scheduler.Node{node("busy", func(n *scheduler.Node) { n.Sandboxes = 3 })}, req); len(cands) != 0 {
		t.Error("sandbox count limit ignored")
	}
}

func TestScore(t *testing.T) {
	t.Run("load", func(t *testing.T) {
		cands, _ := newSched().Rank([]*scheduler.Node{
			node("loaded", func(n *scheduler.Node) { n.AllocMemoryMiB = 6000; n.Sandboxes = 1 }),
			node("idle", func(n *scheduler.Node) { n.Sandboxes = 1 }),
		}, req)
		if cands[0].Node.ID != "idle" || cands[0].Load <= cands[1].Load {
			t.Fatalf("order: %s %s (%+v)", cands[0].Node.ID, cands[1].Node.ID, cands)
		}
	})
	t.Run("locality", func(t *testing.T) {
		cands, _ := newSched().Rank([]*scheduler.Node{
			node("cold", func(n *scheduler.Node) { n.Sandboxes = 2 }),
			node("warm", func(n *scheduler.Node) { n.Sandboxes = 2; n.TemplateSandboxes["busybox"] = 2 }),
		}, req)
		if cands[0].Node.ID != "warm" || cands[0].Locality != 1 || cands[1].Locality != 0 {
			t.Fatalf("order: %+v", cands)
		}
	})
	t.Run("pool", func(t *testing.T) {
		// Both run the template; one has a warm pool entry of it and wins
		// even with a sandbox more. Control: without the entry, the node
		// with fewer sandboxes wins (spread).
		nodes := func(entries int) []*scheduler.Node {
			return []*scheduler.Node{
				node("plain", func(n *scheduler.Node) { n.Sandboxes = 2; n.TemplateSandboxes["busybox"] = 2 }),
				node("pooled", func(n *scheduler.Node) {
					n.Sandboxes = 3
					n.TemplateSandboxes["busybox"] = 3
					n.TemplatePool = map[string]int{"busybox": entries}
				}),
			}
		}
		cands, _ := newSched().Rank(nodes(1), req)
		if cands[0].Node.ID != "pooled" || cands[0].Pool != 1 || cands[1].Pool != 0 {
			t.Fatalf("with a pool entry: %+v", cands)
		}
		cands, _ = newSched().Rank(nodes(0), req)
		if cands[0].Node.ID != "plain" {
			t.Fatalf("control, no pool entry: %+v", cands)
		}
	})
	t.Run("spread", func(t *testing.T) {
		// A big node with many sandboxes and a small empty one: load alone
		// would keep filling the big one; spread sends this one to the small.
		cands, _ := newSched().Rank([]*scheduler.Node{
			node("big", func(n *scheduler.Node) {
				n.MemoryMiB = 65536
				n.MilliCPU = 32000
				n.Sandboxes = 10
				n.AllocMemoryMiB = 5120
				n.AllocMilliCPU = 10000
			}),
			node("small", func(n *scheduler.Node) {}),
		}, req)
		if cands[0].Node.ID != "small" {
			t.Fatalf("order: %s first (%+v)", cands[0].Node.ID, cands)
		}
	})
	t.Run("ties spread out", func(t *testing.T) {
		first := map[string]int{}
		s := scheduler.New(testConfig())
		for range 200 {
			cands, _ := s.Rank([]*scheduler.Node{node("a"), node("b"), node("c")}, req)
			first[cands[0].Node.ID]++
		}
		for _, id := range []string{"a", "b", "c"} {
			if first[id] < 20 {
				t.Fatalf("tie-break not random: %v", first)
			}
		}
	})
}

func TestPlaceRetry(t *testing.T) {
	ctx := context.Background()
	nodes := []*scheduler.Node{
		node("a", func(n *scheduler.Node) { n.Sandboxes = 0 }),
		node("b", func(n *scheduler.Node) { n.Sandboxes = 1 }),
		node("c", func(n *scheduler.Node) { n.Sandboxes = 2 }),
	}
	var tried []string
	try := func(fail map[string]error) func(context.Context, *scheduler.Node) error {
		tried = nil
		return func(_ context.Context, n *scheduler.Node) error {
			tried = append(tried, n.ID)
			return fail[n.ID]
		}
	}
	// Refusals move on; the third node takes it.
	got, err := newSched().Place(ctx, nodes, req, try(map[string]error{
		"a": fmt.Errorf("create limit: %w", errdefs.ErrResourceExhausted),
		"b": fmt.Errorf("dial: %w", errdefs.ErrUnavailable),
	}))
	if err != nil || got.ID != "c" || fmt.Sprint(tried) != "[a b c]" {
		t.Fatalf("got %v %v after %v", got, err, tried)
	}
	// Any other error stops at once.
	_, err = newSched().Place(ctx, nodes, req, try(map[string]error{"a": fmt.Errorf("bad env: %w", errdefs.ErrInvalidArgument)}))
	if !errdefs.IsInvalidArgument(err) || len(tried) != 1 {
		t.Fatalf("non-retryable: %v after %v", err, tried)
	}
	// Every node refuses: ResourceExhausted, naming each refusal.
	all := map[string]error{}
	for _, n := range nodes {
		all[n.ID] = fmt.Errorf("full: %w", errdefs.ErrResourceExhausted)
	}
	_, err = newSched().Place(ctx, nodes, req, try(all))
	var nn *scheduler.NoNodeError
	if !errors.As(err, &nn) || !errdefs.IsResourceExhausted(err) || len(nn.Refusals) != 3 || !nn.Transient() {
		t.Fatalf("all refuse: %v", err)
	}
	// MaxAttempts bounds the tries.
	cfg := testConfig()
	cfg.MaxAttempts = 2
	_, _ = scheduler.New(cfg).Place(ctx, nodes, req, try(all))
	if len(tried) != 2 {
		t.Fatalf("max attempts: tried %v", tried)
	}
}

func TestNoNodeClassification(t *testing.T) {
	ctx := context.Background()
	never := func(context.Context, *scheduler.Node) error { t.Fatal("try called"); return nil }
	for _, tc := range []struct {
		name  string
		nodes []*scheduler.Node
		req   scheduler.Request
		is    func(error) bool
		// transient: worth trying again in a moment (a node only
		// unhealthy); the rest fail the same until something changes.
		transient bool
	}{
		{"no nodes", nil, req, errdefs.IsUnavailable, false},
		{"template nowhere", []*scheduler.Node{node("a"), node("b")}, scheduler.Request{TemplateID: "ghost", MemoryMiB: 1}, errdefs.IsNotFound, false},
		{"all unhealthy", []*scheduler.Node{node("a", func(n *scheduler.Node) { n.Healthy = false })}, req, errdefs.IsUnavailable, true},
		{"too big everywhere", []*scheduler.Node{node("a", func(n *scheduler.Node) { n.MaxMemoryMiB = 100 })}, req, errdefs.IsInvalidArgument, false},
		{"runtime nowhere", []*scheduler.Node{node("a")}, scheduler.Request{TemplateID: "busybox", Runtime: "vm"}, errdefs.IsFailedPrecondition, false},
		{"full, and another sick", []*scheduler.Node{
			node("a", func(n *scheduler.Node) { n.AllocMemoryMiB = 8192 }),
			node("b", func(n *scheduler.Node) { n.Healthy = false }),
		}, req, errdefs.IsResourceExhausted, true},
		{"cordoned", []*scheduler.Node{node("a", func(n *scheduler.Node) { n.Schedulable = false })}, req, errdefs.IsUnavailable, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := newSched().Place(ctx, tc.nodes, tc.req, never)
			if !tc.is(err) {
				t.Fatalf("wrong class: %v", err)
			}
			var nn *scheduler.NoNodeError
			if !errors.As(err, &nn) || nn.Transient() != tc.transient {
				t.Fatalf("%v: transient %v, want %v", err, nn != nil && nn.Transient(), tc.transient)
			}
		})
	}
}

// TestBusyRanksLast: a busy node is tried after every node that is not,
// even with the best score, and is still placed on when it is the only
// one; healthy nodes that all refuse with Unavailable (unreachable for a
// moment) make the placement ResourceExhausted (429, retry), not
// Unavailable (503: nothing healthy).
func TestBusyRanksLast(t *testing.T) {
	ctx := context.Background()
	busy := node("a", func(n *scheduler.Node) { n.Busy = true }) // empty: the best score
	other := node("b", func(n *scheduler.Node) { n.Sandboxes, n.AllocMilliCPU = 5, 5000 })
	cands, _ := newSched().Rank([]*scheduler.Node{busy, other}, req)
	if len(cands) != 2 || cands[0].Node.ID != "b" || cands[0].Score >= cands[1].Score {
		t.Fatalf("ranking %v: want b (worse score, not busy) before a (busy)", cands)
	}
	// Control: without Busy, a's score wins.
	busy.Busy = false
	if cands, _ := newSched().Rank([]*scheduler.Node{busy, other}, req); cands[0].Node.ID != "a" {
		t.Fatalf("control: %s first, want a", cands[0].Node.ID)
	}
	busy.Busy = true
	got, err := newSched().Place(ctx, []*scheduler.Node{busy}, req, func(context.Context, *scheduler.Node) error { return nil })
	if err != nil || got.ID != "a" {
		t.Fatalf("only a busy node: %v %v", got, err)
	}
	_, err = newSched().Place(ctx, []*scheduler.Node{busy, other}, req, func(_ context.Context, n *scheduler.Node) error {
		return fmt.Errorf("dial %s: %w", n.ID, errdefs.ErrUnavailable)
	})
	if !errdefs.IsResourceExhausted(err) {
		t.Fatalf("healthy nodes refusing: %v, want ResourceExhausted", err)
	}
}
