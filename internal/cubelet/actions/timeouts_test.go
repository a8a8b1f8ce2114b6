package actions

import (
	"context"
	"errors"
	goruntime "runtime"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet/config"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// TestScaledTimeout: the agent wait grows with the accelerator (TCG) and
// with the waits in flight beyond the CPUs, and is the configured value
// for a lone sandbox on KVM or a container runtime.
func TestScaledTimeout(t *testing.T) {
	const base = 20 * time.Second
	for _, c := range []struct {
		accel         string
		waiting, cpus int
		want          time.Duration
	}{
		{"", 1, 2, base},
		{"kvm", 2, 2, base},
		{"", 8, 2, 4 * base},
		{"tcg", 1, 2, TCGSlowdown * base},
		{"tcg", 8, 2, 4 * TCGSlowdown * base},
		{"tcg", 3, 2, 3 * TCGSlowdown * base / 2},
		{"", 5, 0, base},
	} {
		if got := scaledTimeout(base, c.accel, c.waiting, c.cpus); got != c.want {
			t.Errorf("scaledTimeout(%s, %q, %d waiting, %d CPUs) = %s, want %s", base, c.accel, c.waiting, c.cpus, got, c.want)
		}
	}
}

// TestAgentWaitStretches: the agent wait of a lone sandbox ends after
// agent_ready_timeout; with three times as many waits in flight as CPUs
// it lasts about three times as long (each second counts a third).
func TestAgentWaitStretches(t *testing.T) {
	cfg, err := config.Parse([]byte("[sandbox]\nagent_ready_timeout = \"300ms\"\n"))
	if err != nil {
		t.Fatal(err)
	}
	// The host's own load is fixed at idle: the case is this node's.
	defer func(f func() int) { hostRunnable = f }(hostRunnable)
	hostRunnable = func() int { return 0 }
	n := &Node{Cfg: cfg}
	rec := &sandbox.Record{ID: "x", Runtime: "runc"}
	wait := func() time.Duration {
		start := time.Now()
		ctx, cancel := n.agentWait(context.Background(), rec)
		defer cancel()
		<-ctx.Done()
		if !errors.Is(context.Cause(ctx), context.DeadlineExceeded) {
			t.Fatalf("cause %v", context.Cause(ctx))
		}
		return time.Since(start)
	}
	alone := wait()
	others := 3*goruntime.NumCPU() - 1
	n.agentWaits.n.Add(int64(others))
	loaded := wait()
	n.agentWaits.n.Add(-int64(others))
	t.Logf("alone %s, with %d waits on %d CPUs %s", alone, others+1, goruntime.NumCPU(), loaded)
	if alone < 250*time.Millisecond || alone > 900*time.Millisecond {
		t.Errorf("alone: %s, want about 300ms", alone)
	}
	if loaded < 800*time.Millisecond || loaded > 3*time.Second {
		t.Errorf("loaded: %s, want about 900ms", loaded)
	}
	// The host's runnable threads count as well.
	hostRunnable = func() int { return 3 * goruntime.NumCPU() }
	busy := wait()
	t.Logf("with %d runnable threads on the host: %s", 3*goruntime.NumCPU(), busy)
	if busy < 800*time.Millisecond || busy > 3*time.Second {
		t.Errorf("busy host: %s, want about 900ms", busy)
	}
}

// TestAgentWaitCeiling: on a host so loaded that the CPU-share budget
// would last a minute, the wait still ends at sandbox.agent_ready_max of
// wall time, and says so. Control: the same load without that ceiling
// (an hour) is still waiting well after it.
func TestAgentWaitCeiling(t *testing.T) {
	defer func(f func() int) { hostRunnable = f }(hostRunnable)
	hostRunnable = func() int { return 200 * goruntime.NumCPU() } // 300ms × 200 = 60s
	rec := &sandbox.Record{ID: "x", Runtime: "runc"}
	node := func(ceiling string) *Node {
		cfg, err := config.Parse([]byte("[sandbox]\nagent_ready_timeout = \"300ms\"\nagent_ready_max = \"" + ceiling + "\"\n"))
		if err != nil {
			t.Fatal(err)
		}
		return &Node{Cfg: cfg}
	}

	start := time.Now()
	ctx, cancel := node("700ms").agentWait(context.Background(), rec)
	defer cancel()
	select {
	case <-ctx.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("agent wait still running 10s after a 700ms ceiling")
	}
	took, cause := time.Since(start), context.Cause(ctx)
	t.Logf("with 200 runnable threads per CPU, ceiling 700ms: ended after %s: %v", took, cause)
	if took < 650*time.Millisecond || took > 3*time.Second {
		t.Errorf("ended after %s, want about 700ms", took)
	}
	if !errors.Is(cause, errAgentWait) || !errors.Is(cause, context.DeadlineExceeded) || !strings.Contains(cause.Error(), "agent_ready_max 700ms") {
		t.Errorf("cause %v: want the agent wait's, naming agent_ready_max", cause)
	}

	ctx, cancel = node("1h").agentWait(context.Background(), rec)
	defer cancel()
	select {
	case <-ctx.Done():
		t.Fatalf("control: without the ceiling the wait ended anyway: %v", context.Cause(ctx))
	case <-time.After(2 * time.Second):
		t.Logf("control: ceiling 1h, same load: still waiting after 2s")
	}
}

// TestHostRunnable reads a plausible count from /proc/loadavg.
func TestHostRunnable(t *testing.T) {
	if r := hostRunnable(); r < 1 || r > 1<<20 {
		t.Fatalf("hostRunnable() = %d", r)
	}
}
