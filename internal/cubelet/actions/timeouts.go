package actions

import (
	"context"
	"errors"
	"fmt"
	goruntime "runtime"
	"sync/atomic"
	"time"

	"github.com/cubesandbox/cube/internal/hostload"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// TCGSlowdown is how much longer a VM takes to boot under TCG (QEMU
// emulating the CPU, no KVM) than a sandbox of the other runtimes or a
// VM under KVM: the factor agent waits of TCG VMs are scaled by.
const TCGSlowdown = 6

// accelerated is a runtime driver that runs on a CPU accelerator it can
// name: the vm driver ("kvm" or "tcg").
type accelerated interface{ Accel() string }

var _ accelerated = (*vmRuntime)(nil)

// agentWait bounds the wait for rec's agent after its runtime started it:
// sandbox.agent_ready_timeout scaled by what the node can do
// (docs/timeouts.md). The wait ends once the sandbox has had
//
//	agent_ready_timeout × accel
//
// of CPU share, where each wall-clock second counts min(1, CPUs / busy):
// accel is TCGSlowdown for a VM under TCG, 1 otherwise; busy is the
// larger of the sandboxes of this node waiting for their agent (this one
// included) and the host's runnable threads, sampled every 100 ms; CPUs
// are the host's. Under a steady load that is agent_ready_timeout ×
// accel × max(1, busy / CPUs) of wall time: booting guests share the CPUs
// with each other and whatever else runs, and eight TCG VMs on two CPUs
// each boot about four times slower than one alone. A wait that began
// alone stretches when more work begins after it.
//
// However far the load stretches it, the wait ends after
// sandbox.agent_ready_max of wall time: a guest that will never answer
// (hung in its kernel or init while QEMU lives on) must fail the create
// in bounded time, and on a loaded host the CPU-share budget alone
// stretches past an hour (12 min of share for a TCG VM at 120 s, times
// the load).
func (n *Node) agentWait(ctx context.Context, rec *sandbox.Record) (context.Context, context.CancelFunc) {
	done := n.agentWaits.start()
	budget := scaledTimeout(n.Cfg.Sandbox.AgentReadyTimeout.Duration, n.accelOf(rec), 1, 1)
	ceiling := n.Cfg.Sandbox.AgentReadyMax.Duration
	ctx, cancel := context.WithCancelCause(ctx)
	stop := make(chan struct{})
	go func() {
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		var had time.Duration
		last, begin := time.Now(), time.Now()
		for {
			select {
			case <-stop:
				return
			case <-ctx.Done():
				return
			case now := <-tick.C:
				had += share(now.Sub(last), max(int(n.agentWaits.n.Load()), hostRunnable()), goruntime.NumCPU())
				last = now
				if had >= budget {
					cancel(fmt.Errorf("%w: %s of CPU share spent (%s of wall time, sandbox.agent_ready_timeout %s scaled by accelerator and load): %w",
						errAgentWait, budget, now.Sub(begin).Round(time.Millisecond), n.Cfg.Sandbox.AgentReadyTimeout.Duration, context.DeadlineExceeded))
					return
				}
				if ceiling > 0 && now.Sub(begin) >= ceiling {
					cancel(fmt.Errorf("%w: sandbox.agent_ready_max %s of wall time spent (%s of %s CPU share had): %w",
						errAgentWait, ceiling, had.Round(time.Millisecond), budget, context.DeadlineExceeded))
					return
				}
			}
		}
	}()
	return ctx, func() {
		close(stop)
		cancel(nil)
		done()
	}
}

// hostRunnable is the host's runnable threads now (the numerator of the
// fourth field of /proc/loadavg), 0 when unknown. A variable so tests
// can fix it.
var hostRunnable = hostload.Runnable

// errAgentWait is the cause of an agent wait whose budget ran out.
var errAgentWait = errors.New("agent wait")

// withWaitCause adds to err why ctx, an agentWait context, ended when its
// budget ran out (the wait's own error says only that it was canceled).
func withWaitCause(ctx context.Context, err error) error {
	if cause := context.Cause(ctx); err != nil && errors.Is(cause, errAgentWait) {
		return fmt.Errorf("%w (%v)", err, cause)
	}
	return err
}

// share is the CPU share a waiting sandbox had in d with waiting
// sandboxes on cpus CPUs.
func share(d time.Duration, waiting, cpus int) time.Duration {
	if cpus > 0 && waiting > cpus {
		return d * time.Duration(cpus) / time.Duration(waiting)
	}
	return d
}

// accelOf is rec's runtime's accelerator ("" when it has none to name).
func (n *Node) accelOf(rec *sandbox.Record) string {
	d, err := n.Driver(rec.Runtime)
	if err != nil {
		return ""
	}
	if a, ok := d.(accelerated); ok {
		return a.Accel()
	}
	return ""
}

// scaledTimeout is the wall time agentWait allows under a steady load.
func scaledTimeout(base time.Duration, accel string, waiting, cpus int) time.Duration {
	d := base
	if accel == "tcg" {
		d *= TCGSlowdown
	}
	if cpus > 0 && waiting > cpus {
		d = d * time.Duration(waiting) / time.Duration(cpus)
	}
	return d
}

// counter counts what is in progress.
type counter struct{ n atomic.Int64 }

// start counts one more until the returned func is called.
func (c *counter) start() func() {
	c.n.Add(1)
	return func() { c.n.Add(-1) }
}
