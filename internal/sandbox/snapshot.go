package sandbox

import (
	"github.com/cubesandbox/cube/internal/network/policy"
	"maps"
	"time"
)

// Snapshot is a point-in-time copy of a sandbox's disk (and, where the
// runtime can checkpoint, its memory), kept in the pool independently of
// the sandbox: it stays valid after its sandbox is destroyed.
//
// Invariant (like Record's): the record is written with State
// SnapshotCreating BEFORE any of its files exist, so after a crash at any
// instant reconcile finds the files through it and removes them. Only a
// SnapshotReady snapshot is visible through the API.
type Snapshot struct {
	ID   string `json:"id"`
	Name string `json:"name,omitempty"`
	// Lineage: the sandbox it was taken of, the snapshot that sandbox
	// came from (clone or rollback), and the template under both.
	SandboxID        string `json:"sandbox_id"`
	ParentSnapshotID string `json:"parent_snapshot_id,omitempty"`
	TemplateID       string `json:"template_id"`
	Runtime          string `json:"runtime"`

	Labels    map[string]string `json:"labels,omitempty"`
	CreatedAt time.Time         `json:"created_at"`
	State     SnapshotState     `json:"state"`

	// Dir holds every file of the snapshot; DiskPath is inside it.
	Dir      string `json:"dir"`
	DiskPath string `json:"disk_path"`
	// MemoryDir is the runtime's memory image ("" when disk only).
	MemoryDir string `json:"memory_dir,omitempty"`
	HasMemory bool   `json:"has_memory"`
	// WarmFor is the template whose warm snapshot this is: retention
	// never removes it, and it goes with the template (or a re-warm).
	WarmFor string `json:"warm_for,omitempty"`
	// SizeBytes is what the snapshot's files have allocated (st_blocks),
	// extents shared with other clones included.
	SizeBytes int64 `json:"size_bytes"`

	// What a clone of the snapshot inherits from its sandbox.
	Resources Resources         `json:"resources"`
	Env       map[string]string `json:"env,omitempty"`
	// NetworkPolicy is the sandbox's egress policy when it was taken: a
	// clone of a locked-down sandbox must not come up with internet.
	NetworkPolicy *policy.Policy `json:"network_policy,omitempty"`
	// AccessToken is the token the snapshotted agent held: a clone
	// restored from the memory image answers it until its reinit gives
	// it the clone's own.
	AccessToken string `json:"access_token,omitempty"`
}

// SnapshotState is where a snapshot is in its own short life.
type SnapshotState string

const (
	// SnapshotCreating: the record exists, its files may be half written.
	SnapshotCreating SnapshotState = "creating"
	// SnapshotReady: complete and usable by clone and rollback.
	SnapshotReady SnapshotState = "ready"
)

// Clone returns a deep copy.
func (s *Snapshot) Clone() *Snapshot {
	c := *s
	c.Labels = maps.Clone(s.Labels)
	c.Env = maps.Clone(s.Env)
	return &c
}

// HostMount is a host path bound into a sandbox. Source is the path after
// symlinks were resolved at create time, so the record says exactly what
// the sandbox can see.
type HostMount struct {
	Source      string `json:"source"`
	Destination string `json:"destination"`
	ReadOnly    bool   `json:"read_only"`
}

// Volume is a volume of the node's storage pool mounted into a sandbox
// at Path; SizeMiB is the capacity its image is made with on first mount.
type Volume struct {
	ID      string `json:"id"`
	Path    string `json:"path"`
	SizeMiB int64  `json:"size_mib"`
}
