// Package actions holds cubelet's workflow actions, one file per resource
// with every verb of that resource (storage.go: pool, disk, rootfs;
// container.go; network.go; agent.go; memory.go: the snapshot's memory,
// quiesce and thaw; diskpause.go: checkpoint, evict, restore;
// runtimes.go), the one verb table that makes their capabilities callable
// by the engine (verbs.go), and Task, the per-run state the engine passes
// to every step (task.go). The cubelet core wires them up and runs the
// flows; this package never imports it.
package actions

import (
	"context"
	"fmt"
	"os"

	"github.com/cubesandbox/cube/internal/cubelet/config"
	"github.com/cubesandbox/cube/internal/cubelet/netagent"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/storage"
	"github.com/cubesandbox/cube/internal/workflow"
)

// AgentPath is where templates carry the agent.
const AgentPath = "/usr/local/bin/cube-agent"

// Node is what the actions share: filled in by the init flow, read-only
// afterwards (Disks is set once, after reconcile).
type Node struct {
	Cfg     *config.Config
	Pool    *storage.Pool
	Drivers map[string]runtime.Driver
	// Disks hands out ready template disks; nil until the core starts it
	// after reconcile (creates clone inline meanwhile).
	Disks *storage.DiskPool
	// Net is the network-agent, dialled on first use.
	Net *netagent.Agent
	// agentWaits counts the sandboxes waiting for their agent now
	// (timeouts.go).
	agentWaits counter
}

// NewNode returns the node state for cfg; the init flow fills in the pool
// and the drivers.
func NewNode(cfg *config.Config) *Node {
	return &Node{Cfg: cfg, Net: netagent.New(cfg.Network)}
}

// Register adds every action cubelet knows to reg. Flows in the config
// pick from these by name.
func Register(n *Node, reg *workflow.Registry) {
	reg.MustRegister(
		&poolAction{n: n},
		&runtimesAction{n: n},
		&diskAction{n: n},
		&rootfsAction{n: n},
		&containerAction{n: n},
		&agentAction{n: n},
		&netAction{n: n},
		&memoryAction{n: n},
		&thawAction{n: n},
		&quiesceAction{n: n},
		&checkpointAction{n: n},
		&evictAction{n: n},
		&restoreAction{n: n},
	)
}

// BootsDisk: the runtime boots the sandbox disk itself (a VM), so cubelet
// does not mount it.
func (n *Node) BootsDisk(runtime string) bool {
	d, ok := n.Drivers[runtime]
	return ok && d.Capabilities().BootsDisk
}

// Driver returns the named runtime driver.
func (n *Node) Driver(name string) (runtime.Driver, error) {
	d, ok := n.Drivers[name]
	if !ok {
		return nil, fmt.Errorf("runtime %q is not available on this node: %w", name, errdefs.ErrInvalidArgument)
	}
	return d, nil
}

// Settle makes pause and resume idempotent without an extra runtime call
// on the hot path: only when the verb failed does it ask whether the
// sandbox is already where the caller wants it (an undo of a verb that
// never ran, or a retry after a crash).
func Settle(ctx context.Context, d runtime.Driver, id string, want runtime.Status, err error) error {
	if err == nil {
		return nil
	}
	if st, serr := d.State(ctx, id); serr == nil && st.Status == want {
		return nil
	}
	return err
}

// removeIfEmpty removes a sandbox's run directory once the last thing in
// it (bundle or rootfs mount point) is gone; whichever destroy runs last
// gets it. ENOTEMPTY means another resource is still there: not an error.
func removeIfEmpty(dir string) { _ = os.Remove(dir) }

// sharedAgent is the read-only bind of the node's cube-agent over the
// template's copy: the sandbox's disk copy of the binary would otherwise
// be cached once per sandbox (its own file) and again under the loop
// device's backing file. Skipped when the binary is missing, so a node
// whose agent_binary went away still boots sandboxes from the template.
func (n *Node) sharedAgent() (runtime.Mount, bool) {
	c := n.Cfg.Storage
	if !c.ShareAgentBinary || c.AgentBinary == "" {
		return runtime.Mount{}, false
	}
	if st, err := os.Stat(c.AgentBinary); err != nil || !st.Mode().IsRegular() {
		return runtime.Mount{}, false
	}
	return runtime.Mount{Source: c.AgentBinary, Destination: AgentPath, ReadOnly: true}, true
}
