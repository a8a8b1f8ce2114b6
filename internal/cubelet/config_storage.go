package cubelet

import (
	"fmt"
	"path/filepath"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// DiskPoolConfig is [storage.disk_pool]: ready template disks kept per
// template so creates rename instead of clone.
type DiskPoolConfig struct {
	// Size is the number of ready disks per template; 0 turns the pool off.
	Size int `toml:"size"`
	// RefillPerSecond caps background clones per second; 0 = no cap.
	RefillPerSecond float64 `toml:"refill_per_second"`
}

// HostMountRule is one [[storage.host_mount_allow]] entry: host paths
// under Prefix (after symlinks are resolved) may be bound into sandboxes.
type HostMountRule struct {
	Prefix string `toml:"prefix"`
	// ReadOnly allows only read-only binds under Prefix.
	ReadOnly bool `toml:"read_only"`
}

// SnapshotConfig is [snapshots]: retention and clone fan-out.
type SnapshotConfig struct {
	// Retention; 0 = no limit. The oldest snapshots go first.
	MaxPerSandbox int      `toml:"max_per_sandbox"`
	MaxPerNode    int      `toml:"max_per_node"`
	MaxAge        Duration `toml:"max_age"`
	// CloneParallelism is how many sandboxes one clone call starts at a
	// time (also capped by the clone flow's limit).
	CloneParallelism int `toml:"clone_parallelism"`
}

// finishSnapshots validates the storage settings of the snapshot features.
func (c *Config) finishSnapshots() error {
	bad := func(f string, a ...any) error {
		return fmt.Errorf("config: "+f+": %w", append(a, errdefs.ErrInvalidArgument)...)
	}
	if p := c.Storage.DiskPool; p.Size < 0 || p.RefillPerSecond < 0 {
		return bad("storage.disk_pool size and refill_per_second must not be negative")
	}
	for i, r := range c.Storage.HostMountAllow {
		if !filepath.IsAbs(r.Prefix) || filepath.Clean(r.Prefix) != r.Prefix {
			return bad("storage.host_mount_allow[%d].prefix %q must be a clean absolute path", i, r.Prefix)
		}
		if r.Prefix == "/" {
			return bad("storage.host_mount_allow[%d].prefix must not be /: sandboxes would reach the whole host", i)
		}
	}
	s := c.Snapshots
	if s.MaxPerSandbox < 0 || s.MaxPerNode < 0 || s.MaxAge.Duration < 0 {
		return bad("snapshots retention limits must not be negative")
	}
	if s.CloneParallelism < 1 {
		return bad("snapshots.clone_parallelism must be at least 1")
	}
	return nil
}
