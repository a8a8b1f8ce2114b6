// Package config is cubelet's configuration: the Config struct, its
// embedded default.toml (which documents every key) and the paths derived
// from it.
package config

import (
	"github.com/cubesandbox/cube/internal/objstore"

	"bytes"
	_ "embed"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/serve"
	"github.com/cubesandbox/cube/internal/tomlconfig"
	"github.com/cubesandbox/cube/internal/workflow"
)

//go:embed default.toml
var defaultTOML []byte

// DefaultTOML returns the embedded default configuration (cubelet
// --print-config prints it).
func DefaultTOML() []byte { return bytes.Clone(defaultTOML) }

// Duration is a time.Duration written as "20s" in TOML.
type Duration = tomlconfig.Duration

// Config is cubelet's configuration. See default.toml for every field.
type Config struct {
	Node struct {
		ID             string `toml:"id"`
		DataDir        string `toml:"data_dir"`
		RunDir         string `toml:"run_dir"`
		CgroupParent   string `toml:"cgroup_parent"`
		DefaultRuntime string `toml:"default_runtime"`
	} `toml:"node"`
	API struct {
		Socket  string `toml:"socket"`
		TCP     string `toml:"tcp"`
		Metrics string `toml:"metrics"`
		// Data is the node data listener (package nodetunnel): the ports
		// of this node's sandboxes for proxies and masters, mutual TLS
		// only. Empty = none.
		Data string `toml:"data"`
		// Pprof serves net/http/pprof on the metrics listener (cube-bench
		// --profile reads it). Off by default: profiles expose internals.
		Pprof bool `toml:"pprof"`
	} `toml:"api"`
	// TLS is the node's certificate, key and the cluster CA: mutual TLS
	// on api.tcp and api.metrics and on the link to a master at host:port.
	TLS     serve.TLSFiles `toml:"tls"`
	Storage struct {
		PoolImageSizeMiB    int64  `toml:"pool_image_size_mib"`
		AllowCopy           bool   `toml:"allow_copy"`
		AgentBinary         string `toml:"agent_binary"`
		TemplateHeadroomMiB int64  `toml:"template_headroom_mib"`
		// ShareAgentBinary binds agent_binary read-only over the template's
		// copy, so every sandbox maps one page-cached file.
		ShareAgentBinary bool `toml:"share_agent_binary"`
		// LoopDirectIO binds sandbox disks and volumes with loop direct
		// I/O (storage.DiskOptions says what it costs on a full pool).
		LoopDirectIO   bool            `toml:"loop_direct_io"`
		DiskPool       DiskPoolConfig  `toml:"disk_pool"`
		HostMountAllow []HostMountRule `toml:"host_mount_allow"`
	} `toml:"storage"`

	// Snapshots: retention and clone fan-out.
	Snapshots SnapshotConfig `toml:"snapshots"`
	// Store is the S3-compatible object store snapshots travel between
	// nodes through; off when endpoint is empty. The keys are read from
	// files.
	Store objstore.Config `toml:"store"`

	Registry struct {
		// AuthFile is a docker config.json consulted for registry
		// credentials when an import brings none.
		AuthFile string `toml:"auth_file"`
	} `toml:"registry"`
	Runc struct {
		Binary string `toml:"binary"`
		Root   string `toml:"root"`
	} `toml:"runc"`
	// Gvisor: the runsc driver.
	Gvisor GvisorConfig `toml:"gvisor"`
	// VM: the QEMU driver.
	VM      VMConfig `toml:"vm"`
	Sandbox struct {
		DefaultMilliCPU   int64    `toml:"default_milli_cpu"`
		DefaultMemoryMiB  int64    `toml:"default_memory_mib"`
		DefaultPids       int64    `toml:"default_pids"`
		MaxMilliCPU       int64    `toml:"max_milli_cpu"`
		MaxMemoryMiB      int64    `toml:"max_memory_mib"`
		MaxPids           int64    `toml:"max_pids"`
		MaxDiskMiB        int64    `toml:"max_disk_mib"`
		AgentReadyTimeout Duration `toml:"agent_ready_timeout"`
		// AgentReadyMax caps the agent wait in wall time, however far
		// the load stretched agent_ready_timeout.
		AgentReadyMax Duration `toml:"agent_ready_max"`
	} `toml:"sandbox"`
	GC struct {
		Interval   Duration `toml:"interval"`
		MaxBackoff Duration `toml:"max_backoff"`
		// TemplatesUnusedAfter removes templates no sandbox or snapshot has
		// used for this long; 0 = never.
		TemplatesUnusedAfter Duration `toml:"templates_unused_after"`
		// KeepTemplates are never collected.
		KeepTemplates []string `toml:"keep_templates"`
	} `toml:"gc"`
	Master MasterConfig `toml:"master"`
	// Usage: the per-sandbox resource sampler (package usage).
	Usage struct {
		// Interval between samples; "0s" = no sampling.
		Interval Duration `toml:"interval"`
		// History is how many samples each sandbox keeps.
		History int `toml:"history"`
		// MaxBytes bounds all sandboxes' history together; with more
		// sandboxes than it holds History samples of, each keeps fewer.
		// 0 = no bound.
		MaxBytes int64 `toml:"max_bytes"`
		// SandboxSeries exports per-sandbox series on /metrics.
		SandboxSeries bool `toml:"sandbox_series"`
	} `toml:"usage"`
	// Network: the node's network-agent.
	Network NetworkConfig   `toml:"network"`
	Flows   workflow.Config `toml:"flows"`
	// WarmPool: pre-started, frozen sandboxes that creates claim.
	WarmPool WarmPoolConfig `toml:"warm_pool"`
}

// Load returns the defaults with the file at path (if any) merged
// over them. Unknown keys in the file are an error: a typo must not
// silently fall back to a default.
func Load(path string) (*Config, error) { return tomlconfig.Load[Config](defaultTOML, path) }

// Parse is Load for TOML text already in memory.
func Parse(data []byte) (*Config, error) { return tomlconfig.Parse[Config](defaultTOML, data) }

// Validate checks every field and fills in the ones derived from others
// (tomlconfig.Validator).
func (c *Config) Validate() error {
	bad := func(f string, a ...any) error {
		return fmt.Errorf("config: "+f+": %w", append(a, errdefs.ErrInvalidArgument)...)
	}
	if c.Node.ID == "" {
		h, err := os.Hostname()
		if err != nil {
			return err
		}
		c.Node.ID = h
	}
	for name, p := range map[string]string{"node.data_dir": c.Node.DataDir, "node.run_dir": c.Node.RunDir} {
		if !filepath.IsAbs(p) {
			return bad("%s %q must be an absolute path", name, p)
		}
	}
	if c.Node.CgroupParent == "" || filepath.Base(c.Node.CgroupParent) != c.Node.CgroupParent {
		return bad("node.cgroup_parent %q must be a single path element", c.Node.CgroupParent)
	}
	if c.Runc.Root == "" {
		c.Runc.Root = filepath.Join(c.Node.RunDir, "runc")
	}
	if c.VM.Root == "" {
		c.VM.Root = filepath.Join(c.Node.RunDir, "vm")
	}
	if c.Gvisor.Root == "" {
		c.Gvisor.Root = filepath.Join(c.Node.RunDir, "runsc")
	}
	if o := c.Gvisor.SentryOverheadMiB; o < 0 || o > 1<<20 {
		return bad("gvisor.sentry_overhead_mib %d must be between 0 and %d", o, 1<<20)
	}
	if c.Storage.AgentBinary == "" {
		exe, err := os.Executable()
		if err == nil {
			c.Storage.AgentBinary = filepath.Join(filepath.Dir(exe), "cube-agent")
		}
	}
	s := &c.Sandbox
	if s.DefaultMilliCPU <= 0 || s.DefaultMemoryMiB <= 0 || s.DefaultPids <= 0 {
		return bad("sandbox defaults must be positive")
	}
	if s.DefaultMilliCPU > s.MaxMilliCPU || s.DefaultMemoryMiB > s.MaxMemoryMiB || s.DefaultPids > s.MaxPids {
		return bad("sandbox defaults exceed the maxima")
	}
	if s.AgentReadyTimeout.Duration <= 0 {
		return bad("sandbox.agent_ready_timeout must be positive")
	}
	if s.AgentReadyMax.Duration <= 0 {
		return bad("sandbox.agent_ready_max must be positive")
	}
	if c.GC.Interval.Duration <= 0 {
		return bad("gc.interval must be positive")
	}
	if c.Usage.Interval.Duration < 0 || c.Usage.History < 1 || c.Usage.History > 100000 || c.Usage.MaxBytes < 0 {
		return bad("usage: interval and max_bytes must not be negative, history 1-100000")
	}
	if c.API.Data != "" && !c.TLS.Enabled() {
		// Its only guard is the caller's certificate.
		return bad("api.data %q needs [tls] (cert, key and ca): the node data listener admits only proxy and master certificates", c.API.Data)
	}
	if err := c.WarmPool.validate(); err != nil {
		return err
	}
	return c.finishSnapshots()
}

// Paths derived from the config, in one place so the leak checker,
// reconcile and actions agree.
func (c *Config) StorePath() string { return filepath.Join(c.Node.DataDir, "cubelet.db") }
func (c *Config) PoolDir() string   { return filepath.Join(c.Node.DataDir, "pool") }
func (c *Config) SandboxRunDir(id string) string {
	return filepath.Join(c.Node.RunDir, "sandboxes", id)
}
func (c *Config) CgroupPath(id string) string { return "/" + c.Node.CgroupParent + "/" + id }

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

// GvisorConfig configures the gvisor runtime driver ([gvisor]).
type GvisorConfig struct {
	// Binary is runsc; the driver is skipped when it cannot be found.
	Binary string `toml:"binary"`
	// Root is runsc --root; <run_dir>/runsc when empty.
	Root string `toml:"root"`
	// Platform is runsc --platform: ptrace (default, no KVM), kvm, systrap.
	Platform string `toml:"platform"`
	// Debug keeps runsc debug logs in each sandbox's bundle.
	Debug bool `toml:"debug"`
	// Checkpoint turns on memory snapshots (snapshot = checkpoint, clone
	// and rollback = restore). Off by default: Debian 12's runsc cannot
	// checkpoint a sandbox whose agent listens on TCP (docs/gvisor.md).
	Checkpoint bool `toml:"checkpoint"`
	// SentryOverheadMiB is the memory every gVisor sandbox's cgroup gets
	// above the sandbox's memory limit, for gVisor's sentry and gofer
	// (which runsc puts in that cgroup) and what a checkpoint or restore
	// needs on top; 0 gives the cgroup the sandbox's limit alone
	// (docs/gvisor.md: the sentry is then OOM-killed saving a guest
	// that uses part of its limit).
	SentryOverheadMiB int64 `toml:"sentry_overhead_mib"`
}

// SentryOverhead is SentryOverheadMiB as the gvisor driver's
// Config.SentryOverhead: bytes, and 0 spelled as -1 (none), since the
// driver reads 0 as its default.
func (g GvisorConfig) SentryOverhead() int64 {
	if g.SentryOverheadMiB == 0 {
		return -1
	}
	return g.SentryOverheadMiB << 20
}

// VMConfig configures the vm runtime driver ([vm]): QEMU micro-VMs.
type VMConfig struct {
	// Enabled registers the driver when QEMU and the guest artifacts are
	// found; false skips it.
	Enabled bool `toml:"enabled"`
	// QEMU is the emulator binary; the driver is skipped when missing.
	QEMU string `toml:"qemu"`
	// GuestDir holds the guest kernel and initramfs (go run ./hack/vm-guest).
	GuestDir string `toml:"guest_dir"`
	// Accel: auto (KVM when /dev/kvm works, else TCG), kvm or tcg.
	Accel string `toml:"accel"`
	// Root is the driver's state directory; <run_dir>/vm when empty.
	Root string `toml:"root"`
	// Vhost asks for vhost-net on the TAP, honoured where /dev/vhost-net
	// exists (QEMU aborts with vhost=on elsewhere).
	Vhost bool `toml:"vhost"`
	// ExtraCmdline is appended to every guest's kernel command line.
	ExtraCmdline []string `toml:"extra_cmdline"`
}

// MasterConfig is the [master] section: where cubemaster is, and how this
// node reports to it.
type MasterConfig struct {
	Addr              string   `toml:"addr"`
	Advertise         string   `toml:"advertise"`
	AdvertiseData     string   `toml:"advertise_data"`
	HeartbeatInterval Duration `toml:"heartbeat_interval"`
	Token             string   `toml:"token"`
}

// NetworkConfig is [network]: the node's network-agent.
type NetworkConfig struct {
	// AgentSocket is network-agent's gRPC socket; "" = none (the net
	// action does nothing and sandboxes get an empty namespace).
	AgentSocket  string   `toml:"agent_socket"`
	AgentTimeout Duration `toml:"agent_timeout"`
}
