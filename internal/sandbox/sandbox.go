// Package sandbox holds the node's records: what a sandbox is, what it holds,
// and what a template is. No gRPC, no storage: just the types every other
// package agrees on.
package sandbox

import (
	"regexp"
	"slices"
	"time"

	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/network/policy"
)

// Resources are a sandbox's limits. Zero means the node default.
type Resources struct {
	MilliCPU  int64 `json:"milli_cpu,omitempty"`
	MemoryMiB int64 `json:"memory_mib,omitempty"`
	Pids      int64 `json:"pids,omitempty"`
	DiskMiB   int64 `json:"disk_mib,omitempty"`
}

// Record is one sandbox as the store keeps it.
//
// Invariant: every resource field (Disk, Mount, Container, Network) is written to the
// store BEFORE the resource is created, so after a crash at any instant the
// record names everything that might exist and reconcile can release it.
// A field is cleared only after the resource is gone.
type Record struct {
	ID          string            `json:"id"`
	TemplateID  string            `json:"template_id"`
	Runtime     string            `json:"runtime"`
	State       lifecycle.State   `json:"state"`
	Labels      map[string]string `json:"labels,omitempty"`
	Annotations map[string]string `json:"annotations,omitempty"`
	Env         map[string]string `json:"env,omitempty"`
	Resources   Resources         `json:"resources"`
	RequestID   string            `json:"request_id,omitempty"`
	CreatedAt   time.Time         `json:"created_at"`
	UpdatedAt   time.Time         `json:"updated_at"`
	// Error says why the sandbox is Failed or Unknown.
	Error string `json:"error,omitempty"`
	// SourceSnapshotID is the snapshot the sandbox was cloned or last
	// rolled back from.
	SourceSnapshotID string `json:"source_snapshot_id,omitempty"`
	// PrevState is the state a snapshot or rollback in progress returns
	// the sandbox to; restart reconcile reads it after a crash mid-verb.
	PrevState lifecycle.State `json:"prev_state,omitempty"`
	// HostMounts are bound into the container (allow-listed at create).
	HostMounts []HostMount `json:"host_mounts,omitempty"`
	// Volumes are mounted into the container (actions.MountVolumes).
	Volumes []Volume `json:"volumes,omitempty"`
	// PauseMode is how a Paused sandbox is paused: PauseMemory (frozen,
	// resident) or PauseDisk (memory image under its pool directory, no
	// runtime container: Container names what to restore). Empty otherwise.
	PauseMode PauseMode `json:"pause_mode,omitempty"`

	Disk      *Disk      `json:"disk,omitempty"`
	Mount     *Mount     `json:"mount,omitempty"`
	Container *Container `json:"container,omitempty"`
	// Network is the sandbox's slot from network-agent (nil without one).
	Network *Network `json:"network,omitempty"`
	// NetworkPolicy is the egress policy asked for at create or by the
	// last UpdateSandboxNetwork; nil = the default (internet allowed).
	NetworkPolicy *policy.Policy `json:"network_policy,omitempty"`
	// AccessToken is the token the sandbox's agent requires ("" = none):
	// given at create, handed to the agent as a verifier before it runs,
	// and sent by cubelet on every call it makes to the agent. Never
	// returned by the API.
	AccessToken string `json:"access_token,omitempty"`
	// HostID is the ID the node's resources for the sandbox are held
	// under (container, run directory, cgroup, disk, network slot) when it
	// is not ID: a sandbox claimed from a warm pool keeps the pool entry's
	// resources, which cannot be renamed (a running container's cgroup,
	// runc's state). Empty = ID.
	HostID string `json:"host_id,omitempty"`
	// PoolToken is set while a claim of a warm pool entry is not recorded
	// finished: the entry's agent token, which the agent holds until the
	// claim's reinit replaces it by AccessToken. A restart finishes such a
	// claim (docs/pools.md). Never returned by the API.
	PoolToken string `json:"pool_token,omitempty"`
}

// HostKey is the ID the sandbox's node resources are held under.
func (r *Record) HostKey() string {
	if r.HostID != "" {
		return r.HostID
	}
	return r.ID
}

// PauseMode is how a paused sandbox keeps its memory.
type PauseMode string

const (
	PauseMemory PauseMode = "memory"
	PauseDisk   PauseMode = "disk"
)

// Disk is the sandbox's own copy-on-write disk image in the pool.
type Disk struct {
	Path string `json:"path"`
}

// Mount is the disk loop-mounted as the container's root filesystem.
type Mount struct {
	Target     string `json:"target"`
	Image      string `json:"image"`
	LoopDevice string `json:"loop_device,omitempty"`
}

// Container is the runtime's view of the sandbox.
type Container struct {
	ID         string `json:"id"`
	Bundle     string `json:"bundle"`
	CgroupPath string `json:"cgroup_path"`
	PID        int    `json:"pid,omitempty"`
}

// Clone returns a deep copy, so a record handed out is never shared with
// the one being mutated by a running flow.
func (r *Record) Clone() *Record {
	c := *r
	c.Labels = cloneMap(r.Labels)
	c.Annotations = cloneMap(r.Annotations)
	c.Env = cloneMap(r.Env)
	c.HostMounts = slices.Clone(r.HostMounts)
	c.Volumes = slices.Clone(r.Volumes)
	if r.Disk != nil {
		d := *r.Disk
		c.Disk = &d
	}
	if r.Mount != nil {
		m := *r.Mount
		c.Mount = &m
	}
	if r.Container != nil {
		k := *r.Container
		c.Container = &k
	}
	if r.Network != nil {
		n := *r.Network
		c.Network = &n
	}
	c.NetworkPolicy = clonePolicy(r.NetworkPolicy)
	return &c
}

func cloneMap(m map[string]string) map[string]string {
	if m == nil {
		return nil
	}
	c := make(map[string]string, len(m))
	for k, v := range m {
		c[k] = v
	}
	return c
}

// Template is an imported image, ready to clone disks from.
type Template struct {
	ID         string   `json:"id"`
	Digest     string   `json:"digest"`
	Source     string   `json:"source"`
	ImagePath  string   `json:"image_path"`
	SizeBytes  int64    `json:"size_bytes"`
	Entrypoint []string `json:"entrypoint,omitempty"`
	Cmd        []string `json:"cmd,omitempty"`
	Env        []string `json:"env,omitempty"`
	WorkingDir string   `json:"working_dir,omitempty"`
	User       string   `json:"user,omitempty"`
	// StartCmd is a service started (sh -c, as the sandbox's default user)
	// in every sandbox booted from this template; ReadyCmd exits 0 once it
	// serves, and the create waits for that. From the image's labels
	// (template.LabelStartCmd, LabelReadyCmd).
	StartCmd string `json:"start_cmd,omitempty"`
	ReadyCmd string `json:"ready_cmd,omitempty"`
	// DefaultWorkdir is where commands start (template.LabelWorkdir);
	// the user's home when empty.
	DefaultWorkdir string    `json:"default_workdir,omitempty"`
	CreatedAt      time.Time `json:"created_at"`
	// AgentDigest is the sha256 of the cube-agent injected into the
	// image: a later import of the same Digest reuses this image only
	// while the node's agent is the same.
	AgentDigest string `json:"agent_digest,omitempty"`
	// RebuiltAt is when the image was last rebuilt in place (a new agent);
	// zero when it is the one made at CreatedAt.
	RebuiltAt time.Time `json:"rebuilt_at,omitzero"`
	// Runtime is what creates from this template run on when they name
	// none ("" = the node default).
	Runtime string `json:"runtime,omitempty"`
	// WarmSnapshotID is a memory snapshot of a sandbox booted from this
	// template (WarmTemplate): creates restore it instead of booting.
	WarmSnapshotID string `json:"warm_snapshot_id,omitempty"`
}

// JournalEntry is a destroy that failed and is retried by the cleanup loop
// until it succeeds.
type JournalEntry struct {
	SandboxID   string    `json:"sandbox_id"`
	Attempts    int       `json:"attempts"`
	LastError   string    `json:"last_error"`
	NextAttempt time.Time `json:"next_attempt"`
}

// EnvKeyRE matches a valid environment variable name (a letter or '_',
// then letters, digits and '_'): the rule for a sandbox's env, wherever
// it is checked (cubemaster's create, cubelet's create and clone).
var EnvKeyRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
