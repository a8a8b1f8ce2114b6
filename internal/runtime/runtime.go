// Package runtime defines the driver interface every sandbox runtime
// (runc, gvisor, vm) implements. Cubelet owns images, disks and networking;
// a driver only turns a prepared root filesystem into a running, pausable,
// stoppable sandbox.
//
// Layering of internal/runtime/... (each layer imports only the ones to
// its left; no driver imports another driver):
//
//	runtime (interfaces)  <-  cgroups, ocispec, userns (helpers)  <-  runc, gvisor, vm (drivers)
//
// The packages:
//   - runtime: Driver, Spec, State, Capabilities and the optional
//     abilities (optional.go); it imports nothing of the project's.
//   - cgroups: finds and removes a sandbox's cgroup in every hierarchy
//     (used by runc, gvisor, vm).
//   - ocispec: builds a sandbox's OCI runtime spec from a Spec (used by
//     runc, gvisor).
//   - userns: host ID ranges for sandboxes' user namespaces and idmapped
//     mounts through them (used by runc).
//   - runtimetest: the conformance suite; it imports runtime only, and
//     each driver's tests run it.
//
// Contract for every implementation (checked by the conformance suite):
//   - Start with an ID that already exists fails with errdefs.ErrAlreadyExists.
//   - Stop is idempotent: stopping an absent sandbox returns nil, and after it
//     returns nothing the driver created for that ID is left (process, cgroup,
//     state dir).
//   - State of an absent sandbox returns an error wrapping errdefs.ErrNotFound.
//   - Verbs a driver cannot do return errdefs.ErrNotImplemented and are
//     reported false in Capabilities (Resume goes with Pause); Restore is
//     reported only with Checkpoint.
//   - Optional abilities beyond the verbs are the small interfaces in
//     optional.go; a driver that has one asserts it at compile time.
//   - Sandboxes outlive the cubelet process: nothing a driver starts may be
//     tied to the caller's lifetime (no pipes held, no parent-death signal).
package runtime

import (
	"context"
	"time"
)

// Capabilities says which verbs a driver supports.
type Capabilities struct {
	Pause      bool `json:"pause"`
	Checkpoint bool `json:"checkpoint"`
	Restore    bool `json:"restore"`
	// BootsDisk: the runtime boots Spec.Disk itself (a VM) instead of
	// running processes on a host-mounted Spec.RootFS.
	BootsDisk bool `json:"boots_disk"`
	// SlotTAP: the sandbox's NIC is a TAP device in its network slot
	// (a VM) instead of the slot's namespace being the sandbox's own.
	SlotTAP bool `json:"slot_tap"`
	// NeedsSlot: the sandbox runs its own network stack, so its agent is
	// reachable only at a network slot's address (gVisor), never by
	// entering a bare namespace as a runc sandbox's is.
	NeedsSlot bool `json:"needs_slot"`
	// PauseFreezes: Pause freezes the sandbox's processes in place (the
	// cgroup freezer; gVisor's sentry stopping its tasks) and Resume
	// returns once the kernel (host or sentry) reports them thawed: they
	// run on as they were, their sockets open, so an agent that answered
	// before the pause answers again without being asked.
	PauseFreezes bool `json:"pause_freezes"`
}

// Limits are the resource limits applied to the sandbox's cgroup.
// Zero means "no limit".
type Limits struct {
	MilliCPU  int64 `json:"milli_cpu"` // 1000 = one vCPU
	MemoryMiB int64 `json:"memory_mib"`
	Pids      int64 `json:"pids"`
}

// Spec is everything a driver needs to start a sandbox.
type Spec struct {
	ID         string            // runtime-level ID, unique per node
	BundleDir  string            // a directory owned by this sandbox for driver files (config.json, logs)
	RootFS     string            // mounted root filesystem (container runtimes)
	Disk       string            // raw ext4 image booted as the root disk (VM runtimes; RootFS is empty then)
	Args       []string          // PID 1 (cube-agent) and its arguments
	Env        []string          // KEY=VALUE
	Cwd        string            // working directory of PID 1, "/" when empty
	Hostname   string            // defaults to ID
	Limits     Limits            //
	CgroupPath string            // e.g. "/cube/<id>"; the driver creates and removes it
	NetNSPath  string            // join this network namespace; "" = a new, empty one
	Mounts     []Mount           // extra bind mounts
	Labels     map[string]string // annotations, informational
	// AgentTokenHash is the verifier (hex SHA-256) of the sandbox's agent
	// access token, "" for none. The runtime hands it to PID 1 before it
	// runs — containers in its environment, VMs on the kernel command
	// line — so the agent refuses requests without the token from its
	// first. Only the hash: both places are readable inside the sandbox.
	AgentTokenHash string
	// Resolver, when set, is the nameserver PID 1 writes into the
	// sandbox's /etc/resolv.conf before it serves — containers get it in
	// its environment, VMs on the kernel command line — so every runtime
	// gets the same file from inside the sandbox. "" leaves the file as
	// the image has it.
	Resolver string
	// EgressCA, when set, is a CA certificate (DER) PID 1 adds to the
	// sandbox's trust store before it serves (network-agent's egress CA:
	// the egress proxy terminates TLS for hosts with credential rules),
	// handed over like Resolver.
	EgressCA []byte
}

// Mount is a bind mount from the host into the sandbox.
type Mount struct {
	Source      string
	Destination string
	ReadOnly    bool
}

// Status is what the runtime reports about a sandbox.
type Status string

const (
	StatusRunning Status = "running"
	StatusPaused  Status = "paused"
	StatusStopped Status = "stopped" // exists but its init has exited
	StatusCreated Status = "created" // exists, not started
)

// State is a point-in-time view of one sandbox in the runtime.
type State struct {
	ID      string
	PID     int
	Status  Status
	Created time.Time
}

// Driver is one runtime. All methods must be safe for concurrent use on
// different IDs; the caller serialises calls for the same ID.
type Driver interface {
	Name() string
	Capabilities() Capabilities
	// Start cold-boots a sandbox from spec and returns once PID 1 runs.
	Start(ctx context.Context, spec Spec) (State, error)
	// Restore starts a sandbox from a memory checkpoint in dir.
	Restore(ctx context.Context, spec Spec, dir string) (State, error)
	Pause(ctx context.Context, id string) error
	Resume(ctx context.Context, id string) error
	// Checkpoint writes the sandbox's memory image to dir. With leaveRunning
	// the sandbox keeps running afterwards.
	Checkpoint(ctx context.Context, id, dir string, leaveRunning bool) error
	// Stop kills every process of the sandbox and removes its runtime state
	// and cgroup. Absent sandboxes are not an error.
	Stop(ctx context.Context, id string) error
	State(ctx context.Context, id string) (State, error)
	// List returns every sandbox the driver knows of (including ones this
	// process did not start: used by restart reconcile).
	List(ctx context.Context) ([]State, error)
}
