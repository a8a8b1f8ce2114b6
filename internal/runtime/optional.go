package runtime

import (
	"context"
	"net/http"
)

// The optional abilities a driver may have beyond Driver. Cubelet asks for
// one with a type assertion; each driver that has one says so with
// `var _ runtime.X = (*Driver)(nil)`, so a changed signature fails to
// compile instead of silently turning the ability off.

// Describer says in one line what the driver runs on this node (versions,
// accelerator, platform), for node info.
type Describer interface {
	Describe() string
}

// AgentChannel is a driver whose sandboxes expose cube-agent on a
// host-side channel of their own (a VM's virtio-serial or vsock device)
// rather than in a network namespace cubelet can enter.
type AgentChannel interface {
	AgentClient(id string) (*http.Client, error)
}

// AgentWaker is a driver whose memory checkpoint needs the agent quiesced
// first (runsc cannot save an open TCP socket) and that can wake it after
// the restore.
type AgentWaker interface {
	WakeAgent(ctx context.Context, id string) error
}

// InPlaceRestorer can restart a checkpointed sandbox from its memory image
// under the same ID, bundle and namespaces.
type InPlaceRestorer interface {
	RestoreInPlace(ctx context.Context, id, dir string) (State, error)
}

// Reaper is a driver that deletes what a runtime sandbox left behind in
// the background (gVisor's retired runsc slots after a restore in place);
// ReapRetired finishes whatever a crash or a failed attempt left, and is
// called by cubelet's reconcile at start.
type Reaper interface {
	ReapRetired(ctx context.Context) error
}

// BundleRestorer restores a sandbox from its memory image and its bundle
// alone, when the runtime no longer knows the ID: a restore in place cut
// short (its caller killed) after it removed the stopped sandbox and
// before the new one was recorded.
type BundleRestorer interface {
	RestoreBundle(ctx context.Context, id, bundle, dir string) (State, error)
}

// ConsoleLogger keeps a sandbox's console in a file (a VM's serial
// console) and says where.
type ConsoleLogger interface {
	ConsoleLog(id string) (string, error)
}

// ConsoleSealer is a driver whose console file must stop growing once the
// sandbox is up: guest root writes a VM's serial port at will.
type ConsoleSealer interface {
	SealConsole(ctx context.Context, id string) error
}

// MACReporter gives the MAC address of a sandbox's NIC when the driver
// picks one per sandbox (each VM clone has its own).
type MACReporter interface {
	MAC(id string) string
}

// Prober checks cheaply that the driver could start a sandbox now, for
// the node's health conditions: its binaries are there and executable and
// its state directory is writable. It never lists or touches sandboxes,
// so it cannot fail because sandboxes are being created or removed.
type Prober interface {
	Probe(ctx context.Context) error
}

// LimitUpdater changes a running sandbox's CPU, memory and PID limits
// (a warm pool's entry taking the limits of the create that claims it).
type LimitUpdater interface {
	UpdateLimits(ctx context.Context, id string, l Limits) error
}

// HostnameSetter sets a running or frozen sandbox's hostname from the
// host, for sandboxes whose own root may not (a runc container has no
// CAP_SYS_ADMIN). Drivers without it leave the hostname to the agent's
// reinit (gVisor grants the agent CAP_SYS_ADMIN in its own kernel).
type HostnameSetter interface {
	SetHostname(ctx context.Context, id string, pid int, name string) error
}
