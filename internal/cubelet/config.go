package cubelet

import (
	"bytes"
	_ "embed"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cubesandbox/cube/internal/errdefs"
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
		// Pprof serves net/http/pprof on the metrics listener (cube-bench
		// --profile reads it). Off by default: profiles expose internals.
		Pprof bool `toml:"pprof"`
	} `toml:"api"`
	Storage struct {
		PoolImageSizeMiB    int64  `toml:"pool_image_size_mib"`
		AllowCopy           bool   `toml:"allow_copy"`
		AgentBinary         string `toml:"agent_binary"`
		TemplateHeadroomMiB int64  `toml:"template_headroom_mib"`
		// ShareAgentBinary binds agent_binary read-only over the template's
		// copy, so every sandbox maps one page-cached file (actions.go).
		ShareAgentBinary bool `toml:"share_agent_binary"`
		// DiskPool and HostMountAllow: see config_storage.go.
		DiskPool       DiskPoolConfig  `toml:"disk_pool"`
		HostMountAllow []HostMountRule `toml:"host_mount_allow"`
	} `toml:"storage"`

	// Snapshots: retention and clone fan-out (config_storage.go).
	Snapshots SnapshotConfig `toml:"snapshots"`

	Registry struct {
		// AuthFile is a docker config.json consulted for registry
		// credentials when an import brings none.
		AuthFile string `toml:"auth_file"`
	} `toml:"registry"`
	Runc struct {
		Binary string `toml:"binary"`
		Root   string `toml:"root"`
	} `toml:"runc"`
	// Gvisor: the runsc driver (gvisor_config.go).
	Gvisor GvisorConfig `toml:"gvisor"`
	// VM: the QEMU driver (vm_config.go).
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
	} `toml:"sandbox"`
	GC struct {
		Interval   Duration `toml:"interval"`
		MaxBackoff Duration `toml:"max_backoff"`
		// TemplatesUnusedAfter removes templates no sandbox or snapshot has
		// used for this long (templategc.go); 0 = never.
		TemplatesUnusedAfter Duration `toml:"templates_unused_after"`
		// KeepTemplates are never collected.
		KeepTemplates []string `toml:"keep_templates"`
	} `toml:"gc"`
	Master MasterConfig `toml:"master"`
	// Network: the node's network-agent (network.go).
	Network NetworkConfig   `toml:"network"`
	Flows   workflow.Config `toml:"flows"`
}

// LoadConfig returns the defaults with the file at path (if any) merged
// over them. Unknown keys in the file are an error: a typo must not
// silently fall back to a default.
func LoadConfig(path string) (*Config, error) {
	var data []byte
	if path != "" {
		var err error
		if data, err = os.ReadFile(path); err != nil {
			return nil, fmt.Errorf("read config: %w", err)
		}
	}
	c, err := ParseConfig(data)
	if err != nil && path != "" {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	return c, err
}

// ParseConfig is LoadConfig for TOML text already in memory.
func ParseConfig(data []byte) (*Config, error) {
	var c Config
	if err := tomlconfig.Decode(defaultTOML, data, &c); err != nil {
		return nil, err
	}
	if err := c.finish(); err != nil {
		return nil, err
	}
	return &c, nil
}

func (c *Config) finish() error {
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
	if c.GC.Interval.Duration <= 0 {
		return bad("gc.interval must be positive")
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
