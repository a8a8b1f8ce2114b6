package agent_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/agent"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/network/policy"
)

func p50(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

// releaseAll releases every assigned slot, several at a time (as a node
// destroying many sandboxes would).
func releaseAll(t *testing.T, a *agent.Agent) {
	t.Helper()
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for _, n := range a.List(ctx) {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			if ok, err := a.Release(ctx, n.SandboxID); err != nil || !ok {
				t.Errorf("release %s: %v %v", n.SandboxID, ok, err)
			}
		})
	}
	wg.Wait()
}

// TestPoolBurst: 200 creates in a burst all get pooled slots; the p50 of
// EnsureNetwork from the pool and cold is logged (docs/network.md).
func TestPoolBurst(t *testing.T) {
	const burst = 200
	// Refill must keep up with a burst-sized pool; the sequential pooled
	// creates below then find it refilled.
	pooled := nettest.Start(t, nettest.Options{PoolSize: burst + 20, RefillPerSecond: 1000})
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	fillStart := time.Now()
	if err := pooled.Agent.WaitPool(wctx, network.Container, burst+20); err != nil {
		t.Fatalf("pool never filled: %d/%d ready", pooled.Agent.PoolReady(network.Container), burst)
	}
	t.Logf("pool of %d filled in %v", burst, time.Since(fillStart))

	lat := make([]time.Duration, burst)
	errs := make([]error, burst)
	fromPool := make([]bool, burst)
	var wg sync.WaitGroup
	start := time.Now()
	for i := range burst {
		wg.Go(func() {
			t0 := time.Now()
			n, _, err := pooled.Agent.Ensure(ctx, agent.EnsureRequest{SandboxID: fmt.Sprintf("burst-%d", i), Kind: network.Container})
			lat[i], errs[i] = time.Since(t0), err
			fromPool[i] = err == nil && n.FromPool
		})
	}
	wg.Wait()
	total := time.Since(start)
	for i := range burst {
		if errs[i] != nil {
			t.Fatalf("ensure %d: %v", i, errs[i])
		}
		if !fromPool[i] {
			t.Errorf("ensure %d did not get a pooled slot", i)
		}
	}

	// The same pool once refilled, one create at a time (no queueing
	// behind the burst, no refill competing for the CPU).
	if err := pooled.Agent.WaitPool(wctx, network.Container, burst+20); err != nil {
		t.Fatal("pool never refilled")
	}
	seq := make([]time.Duration, 20)
	for i := range seq {
		t0 := time.Now()
		n, _, err := pooled.Agent.Ensure(ctx, agent.EnsureRequest{SandboxID: fmt.Sprintf("seq-%d", i), Kind: network.Container})
		seq[i] = time.Since(t0)
		if err != nil || !n.FromPool {
			t.Fatalf("sequential pooled ensure: %+v %v", n, err)
		}
	}

	// Cold: an agent without a pool, one create at a time.
	cold := nettest.Start(t, nettest.Options{})
	coldLat := make([]time.Duration, 20)
	for i := range coldLat {
		t0 := time.Now()
		n, _, err := cold.Agent.Ensure(ctx, agent.EnsureRequest{SandboxID: fmt.Sprintf("cold-%d", i), Kind: network.Container, Policy: policy.Policy{}})
		coldLat[i] = time.Since(t0)
		if err != nil || n.FromPool {
			t.Fatalf("cold ensure: %+v %v", n, err)
		}
	}
	msg := fmt.Sprintf("EnsureNetwork p50: pooled %v sequential, %v in a burst of %d concurrent (%v for all); cold %v sequential",
		p50(seq).Round(10*time.Microsecond), p50(lat).Round(10*time.Microsecond), burst, total.Round(time.Millisecond),
		p50(coldLat).Round(10*time.Microsecond))
	t.Log(msg)
	fmt.Println(msg)
	t0 := time.Now()
	releaseAll(t, pooled.Agent)
	releaseAll(t, cold.Agent)
	t.Logf("released %d slots in %v", burst+len(seq)+len(coldLat), time.Since(t0))
	// Stop the refill now rather than let it rebuild 220 slots only for the
	// cleanup to tear them down.
	if err := pooled.Agent.Purge(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestPoolRefillRate: the pool refills in the background, never faster
// than its rate limit.
func TestPoolRefillRate(t *testing.T) {
	e := nettest.Start(t, nettest.Options{PoolSize: 6, RefillPerSecond: 10})
	start := time.Now()
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := e.Agent.WaitPool(wctx, network.Container, 6); err != nil {
		t.Fatal(err)
	}
	// 6 slots at 10/s: the first at once, then one every 100 ms.
	if d := time.Since(start); d < 450*time.Millisecond {
		t.Fatalf("6 slots pooled in %v: the rate limit (10/s) was not applied", d)
	}
	// Taking two refills two, and the pool never grows past its size.
	for i := range 2 {
		n := ensure(t, e.Agent, fmt.Sprintf("r%d", i), network.Container, policy.Policy{})
		if !n.FromPool {
			t.Fatal("not from the pool")
		}
	}
	if err := e.Agent.WaitPool(wctx, network.Container, 6); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if got := e.Agent.PoolReady(network.Container); got != 6 {
		t.Fatalf("pool holds %d, want 6", got)
	}
	if h := e.Agent.Health(ctx); !h.OK || h.PoolReady != 6 || h.InUse != 2 {
		t.Fatalf("health: %+v", h)
	}
	releaseAll(t, e.Agent)
}
