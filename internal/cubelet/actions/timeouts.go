package actions

import (
	goruntime "runtime"
	"sync/atomic"
	"time"

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

// agentReadyTimeout is how long rec's agent may take to answer after its
// runtime started it: sandbox.agent_ready_timeout scaled by what the node
// can do at the moment the wait begins (docs/timeouts.md):
//
//	agent_ready_timeout × accel × max(1, waiting / CPUs)
//
// accel is TCGSlowdown for a VM under TCG, 1 otherwise; waiting is the
// sandboxes of this node waiting for their agent now (this one
// included); CPUs are the host's. Booting guests share the CPUs: eight
// TCG VMs on two CPUs each boot about four times slower than one alone.
func (n *Node) agentReadyTimeout(rec *sandbox.Record) time.Duration {
	return scaledTimeout(n.Cfg.Sandbox.AgentReadyTimeout.Duration, n.accelOf(rec), int(n.agentWaits.n.Load()), goruntime.NumCPU())
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

// scaledTimeout is the formula of agentReadyTimeout.
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
