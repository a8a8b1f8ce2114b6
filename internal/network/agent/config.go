package agent

import (
	"bytes"
	_ "embed"
	"fmt"
	"net/netip"
	"path/filepath"
	"regexp"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/network/dnsfwd"
	"github.com/cubesandbox/cube/internal/network/ipam"
	"github.com/cubesandbox/cube/internal/network/policy"
	"github.com/cubesandbox/cube/internal/serve"
	"github.com/cubesandbox/cube/internal/tomlconfig"
)

//go:embed default.toml
var defaultTOML []byte

// DefaultTOML returns the embedded defaults (network-agent --print-config).
func DefaultTOML() []byte { return bytes.Clone(defaultTOML) }

// Config is network-agent's configuration; default.toml documents it.
type Config struct {
	NodeCIDR  string `toml:"node_cidr"`
	Prefix    string `toml:"prefix"`
	RunDir    string `toml:"run_dir"`
	DataDir   string `toml:"data_dir"`
	IPForward bool   `toml:"ip_forward"`
	API       struct {
		Socket string `toml:"socket"`
		HTTP   string `toml:"http"`
	} `toml:"api"`
	// TLS: mutual TLS on api.http (the certificate, key and cluster CA).
	TLS  serve.TLSFiles `toml:"tls"`
	Pool struct {
		Size            int     `toml:"size"`
		VMSize          int     `toml:"vm_size"`
		RefillPerSecond float64 `toml:"refill_per_second"`
	} `toml:"pool"`
	Policy struct {
		OpenPrivate []string `toml:"open_private"`
	} `toml:"policy"`
	DNS    DNSConfig    `toml:"dns"`
	Egress EgressConfig `toml:"egress"`
	Audit  struct {
		// Dir holds <sandbox_id>.jsonl; "" = <data_dir>/audit.
		Dir string `toml:"dir"`
		// KeepHours: files of released sandboxes are removed once
		// unchanged this long (0: never).
		KeepHours int `toml:"keep_hours"`
	} `toml:"audit"`

	cidr   netip.Prefix
	opened []netip.Prefix
}

// DNSConfig is the [dns] section: the sandboxes' DNS forwarder.
type DNSConfig struct {
	Enabled    bool     `toml:"enabled"`
	Upstreams  []string `toml:"upstreams"`
	ResolvConf string   `toml:"resolv_conf"`
	Rate       float64  `toml:"rate"`
	Burst      int      `toml:"burst"`
	MinTTL     int      `toml:"min_ttl_seconds"`
	MaxTTL     int      `toml:"max_ttl_seconds"`
	LogQueries bool     `toml:"log_queries"`
}

// EgressConfig is the [egress] section: the node's egress proxy.
type EgressConfig struct {
	Enabled bool `toml:"enabled"`
	Port    int  `toml:"port"`
	// CADir holds the node's egress CA (made at first start); "" =
	// <data_dir>/egress.
	CADir string `toml:"ca_dir"`
	// UpstreamCA is a PEM file of roots the proxy trusts, instead of the
	// system's, for upstreams whose TLS it re-originates.
	UpstreamCA string `toml:"upstream_ca"`
}

// AuditDir is where per-sandbox audit files go.
func (c *Config) AuditDir() string {
	if c.Audit.Dir != "" {
		return c.Audit.Dir
	}
	return filepath.Join(c.DataDir, "audit")
}

// EgressCADir is where the node's egress CA lives.
func (c *Config) EgressCADir() string {
	if c.Egress.CADir != "" {
		return c.Egress.CADir
	}
	return filepath.Join(c.DataDir, "egress")
}

// Forwarder returns the forwarder's configuration.
func (d DNSConfig) Forwarder() dnsfwd.Config {
	return dnsfwd.Config{Upstreams: d.Upstreams, ResolvConf: d.ResolvConf, Rate: d.Rate, Burst: d.Burst,
		MinTTL: time.Duration(d.MinTTL) * time.Second, MaxTTL: time.Duration(d.MaxTTL) * time.Second,
		LogQueries: d.LogQueries}
}

// Defaults returns the embedded configuration, validated.
func Defaults() *Config {
	c, err := ParseConfig(nil)
	if err != nil {
		panic(err)
	}
	return c
}

// LoadConfig returns the defaults with the file at path (if any) merged
// over them. Unknown keys are an error.
func LoadConfig(path string) (*Config, error) { return tomlconfig.Load[Config](defaultTOML, path) }

// ParseConfig is LoadConfig for TOML text in memory.
func ParseConfig(data []byte) (*Config, error) { return tomlconfig.Parse[Config](defaultTOML, data) }

var prefixRE = regexp.MustCompile(`^[a-z][a-z0-9]{0,7}$`)

// Validate checks every field; the config of a test or of main may be
// built in code, so New calls it too.
func (c *Config) Validate() error {
	bad := func(f string, a ...any) error {
		return fmt.Errorf("config: "+f+": %w", append(a, errdefs.ErrInvalidArgument)...)
	}
	p, err := netip.ParsePrefix(c.NodeCIDR)
	if err != nil {
		return bad("node_cidr %q: %v", c.NodeCIDR, err)
	}
	if err := policy.CheckNodeCIDR(p); err != nil {
		return fmt.Errorf("config: node_cidr: %w", err)
	}
	space, err := ipam.New(p)
	if err != nil {
		return fmt.Errorf("config: node_cidr: %w", err)
	}
	c.cidr = p
	if c.opened, err = policy.ParseOpened(c.Policy.OpenPrivate); err != nil {
		return fmt.Errorf("config: policy.%w", err)
	}
	if !prefixRE.MatchString(c.Prefix) {
		// Link names are <prefix>-<slot>, at most 15 bytes (IFNAMSIZ-1).
		return bad("prefix %q must be 1-8 lowercase letters or digits, starting with a letter", c.Prefix)
	}
	for name, d := range map[string]string{"run_dir": c.RunDir, "data_dir": c.DataDir} {
		if !filepath.IsAbs(d) {
			return bad("%s %q must be an absolute path", name, d)
		}
	}
	switch {
	case c.Pool.Size < 0 || c.Pool.VMSize < 0:
		return bad("pool sizes must not be negative")
	case c.Pool.Size+c.Pool.VMSize > space.Size():
		return bad("pool of %d slots is larger than node_cidr %s, which holds %d", c.Pool.Size+c.Pool.VMSize, p, space.Size())
	case c.Pool.RefillPerSecond <= 0:
		return bad("pool.refill_per_second must be positive")
	case c.Egress.Enabled && (c.Egress.Port <= 0 || c.Egress.Port > 65535 || c.Egress.Port == 53):
		return bad("egress.port %d must be a TCP port other than 53", c.Egress.Port)
	case c.Egress.Enabled && !c.DNS.Enabled:
		// The proxy checks a connection's address against the names the
		// forwarder answered.
		return bad("egress.enabled needs dns.enabled")
	}
	return nil
}

// Opened is the validated [policy] open_private.
func (c *Config) Opened() []netip.Prefix { return c.opened }

// CIDR is the validated node CIDR.
func (c *Config) CIDR() netip.Prefix { return c.cidr }

// NetnsDir is where slot namespaces are pinned.
func (c *Config) NetnsDir() string { return filepath.Join(c.RunDir, "netns") }

// StorePath is the slot store.
func (c *Config) StorePath() string { return filepath.Join(c.DataDir, "network.db") }
