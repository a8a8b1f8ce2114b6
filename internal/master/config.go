package master

import (
	"bytes"
	_ "embed"
	"fmt"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/scheduler"
	"github.com/cubesandbox/cube/internal/objstore"
	"github.com/cubesandbox/cube/internal/sandboxid"
	"github.com/cubesandbox/cube/internal/serve"
	"github.com/cubesandbox/cube/internal/tomlconfig"
)

//go:embed default.toml
var defaultTOML []byte

// DefaultTOML returns the embedded default configuration.
func DefaultTOML() []byte { return bytes.Clone(defaultTOML) }

// Duration is a time.Duration written as "20s" in TOML.
type Duration = tomlconfig.Duration

// Config is cubemaster's configuration; default.toml documents every field.
type Config struct {
	API struct {
		E2B        string `toml:"e2b"`
		Node       string `toml:"node"`
		Socket     string `toml:"socket"`
		AdminToken string `toml:"admin_token"`
		// E2BTLSCert and E2BTLSKey serve TLS on api.e2b (SDKs hold no
		// client certificate: keys authenticate them).
		E2BTLSCert string `toml:"e2b_tls_cert"`
		E2BTLSKey  string `toml:"e2b_tls_key"`
		// Ops is CubeOps, the operators' API and web console (package
		// opsapi); TLS as api.e2b. Empty disables it.
		Ops string `toml:"ops"`
	} `toml:"api"`
	// Console: the admin's login to CubeOps.
	Console struct {
		AdminUser string `toml:"admin_user"`
		// AdminPasswordHash is a bcrypt hash; empty = no password login
		// (team users log in with an API key).
		AdminPasswordHash string   `toml:"admin_password_hash"`
		SessionTTL        Duration `toml:"session_ttl"`
	} `toml:"console"`
	// TLS is the master's certificate, key and the cluster CA: mutual TLS
	// on api.node and towards nodes at host:port.
	TLS   serve.TLSFiles `toml:"tls"`
	Proxy struct {
		Listen string `toml:"listen"`
		Domain string `toml:"domain"`
		// Metrics is the in-process cubeproxy's /metrics listener.
		Metrics string `toml:"metrics"`
		// TLS for the in-process cubeproxy: a certificate and key, or a
		// self-signed certificate made at start (development).
		TLSCert       string `toml:"tls_cert"`
		TLSKey        string `toml:"tls_key"`
		TLSSelfSigned bool   `toml:"tls_self_signed"`
		// API serves the E2B API (api.e2b's handler) on listen too, for
		// the host api.<domain>: domain mode, where SDKs configured by
		// E2B_DOMAIN alone reach the API and every sandbox on one TLS
		// listener. Needs api.e2b and the in-process cubeproxy.
		API bool `toml:"api"`
	} `toml:"proxy"`
	Catalog struct {
		Driver string `toml:"driver"`
		DSN    string `toml:"dsn"`
	} `toml:"catalog"`
	Nodes struct {
		HeartbeatInterval Duration `toml:"heartbeat_interval"`
		UnhealthyAfter    Duration `toml:"unhealthy_after"`
		// LostAfter is how long a node may be silent before its
		// sandboxes are marked failed (lostLoop).
		LostAfter Duration `toml:"lost_after"`
		// RestartWait bounds how long a request waits for a node that
		// cannot take it right now for a reason that passes in seconds
		// (a daemon restarting, a node over its create limit); 0: fail
		// at once.
		RestartWait Duration `toml:"restart_wait"`
		Token       string   `toml:"token"`
	} `toml:"nodes"`
	Sandbox struct {
		DefaultTimeout   Duration `toml:"default_timeout"`
		V1DefaultTimeout Duration `toml:"v1_default_timeout"`
		MaxTimeout       Duration `toml:"max_timeout"`
		MilliCPU         int64    `toml:"milli_cpu"`
		MemoryMiB        int64    `toml:"memory_mib"`
		ExpiryInterval   Duration `toml:"expiry_interval"`
		// ExpiryCallTimeout bounds one deadline action (a kill or a
		// pause on the node): a node that hangs holds up only its own.
		ExpiryCallTimeout Duration `toml:"expiry_call_timeout"`
		// AdoptWindow: a managed sandbox a node holds without a catalog
		// row and without a tombstone is adopted when it was created
		// less than this long ago, destroyed otherwise; 0 adopts none.
		AdoptWindow   Duration `toml:"adopt_window"`
		EnvdVersion   string   `toml:"envd_version"`
		CreateTimeout Duration `toml:"create_timeout"`
	} `toml:"sandbox"`
	Templates struct {
		Aliases map[string]string `toml:"aliases"`
		// StoreDir holds the template store (package tmplstore): the
		// images of templates imported through the master, which every
		// node pulls.
		StoreDir string `toml:"store_dir"`
		// ObjectStore, when set, holds every stored template's image, so
		// that every replica of the catalog serves it to its nodes (each
		// keeps a copy in store_dir). Without it, a template's image is
		// served only by the replica that imported it.
		ObjectStore objstore.Config `toml:"object_store"`
	} `toml:"templates"`
	Scheduler scheduler.Config `toml:"scheduler"`
	APIKeys   struct {
		CacheTTL Duration `toml:"cache_ttl"`
	} `toml:"apikeys"`
	// HA is the replicated control plane: replicas on one MySQL catalog
	// and the lease under which one of them runs the lifecycle loops.
	HA struct {
		// ReplicaID names this replica; "" = the host name. Replicas of
		// one catalog need distinct IDs.
		ReplicaID string `toml:"replica_id"`
		// LeaseTTL is how long the loops' lease lasts without renewal;
		// the holder renews it every lease_ttl/3 and stops its loops
		// lease_ttl/4 before it could lapse.
		LeaseTTL Duration `toml:"lease_ttl"`
	} `toml:"ha"`
	// Join lets new nodes obtain a node certificate with a one-time token
	// (cube join) instead of the CA key.
	Join struct {
		// Listen is the join listener (HTTPS, no client certificate:
		// the token authenticates); "" = none.
		Listen string `toml:"listen"`
		// CADir holds the cluster CA (ca.crt, ca.key) the master signs
		// joining nodes' certificates with.
		CADir string `toml:"ca_dir"`
		// Hosts are the names the join listener's certificate carries
		// besides its address (its clients pin the CA, not a name).
		Hosts []string `toml:"hosts"`
	} `toml:"join"`
	// Store: snapshots across nodes. Nodes transfer the files through
	// the object store of their own [store]; the master only decides when.
	Store struct {
		// ExportSnapshots exports every snapshot taken through the master
		// as it is taken, so it outlives its node.
		ExportSnapshots bool `toml:"export_snapshots"`
		// ExportOnPause exports a paused sandbox's snapshot as it
		// pauses; its node's loss then resumes it elsewhere (lost.go).
		ExportOnPause bool `toml:"export_on_pause"`
	} `toml:"store"`
	// Drain: moving running sandboxes off a node (drain.go).
	Drain struct {
		// RequestWait bounds how long a running sandbox's move waits,
		// its traffic held, for the requests already in flight to it
		// through the proxies to finish before it freezes (quiesce.go);
		// 0: it freezes at once. At most MaxRequestWait.
		RequestWait Duration `toml:"request_wait"`
	} `toml:"drain"`
	// Secrets: the master key that seals teams' secrets in the catalog.
	Secrets struct {
		// KeyFile holds the key (hex, mode 0600), made at first start
		// when absent. Empty: secrets.key beside a SQLite catalog; with
		// MySQL it must be set, to the same key on every replica.
		KeyFile string `toml:"key_file"`
	} `toml:"secrets"`
}

// LoadConfig returns the defaults with the file at path (if any) merged
// over them. Unknown keys are an error.
func LoadConfig(path string) (*Config, error) { return tomlconfig.Load[Config](defaultTOML, path) }

// ParseConfig is LoadConfig for TOML text in memory.
func ParseConfig(data []byte) (*Config, error) { return tomlconfig.Parse[Config](defaultTOML, data) }

var versionRE = regexp.MustCompile(`^\d+\.\d+\.\d+$`)

// Validate checks every field (tomlconfig.Validator).
func (c *Config) Validate() error {
	bad := func(f string, a ...any) error {
		return fmt.Errorf("config: "+f+": %w", append(a, errdefs.ErrInvalidArgument)...)
	}
	if c.Catalog.Driver != catalog.SQLite && c.Catalog.Driver != catalog.MySQL {
		return bad("catalog.driver %q: want sqlite or mysql", c.Catalog.Driver)
	}
	if c.Catalog.DSN == "" {
		return bad("catalog.dsn is required")
	}
	if c.Join.Listen != "" && c.Join.CADir == "" {
		return bad("join.listen needs join.ca_dir (the CA that signs joining nodes' certificates)")
	}
	for name, d := range map[string]time.Duration{
		"nodes.heartbeat_interval": c.Nodes.HeartbeatInterval.Duration, "nodes.unhealthy_after": c.Nodes.UnhealthyAfter.Duration,
		"sandbox.default_timeout": c.Sandbox.DefaultTimeout.Duration, "sandbox.v1_default_timeout": c.Sandbox.V1DefaultTimeout.Duration,
		"sandbox.max_timeout": c.Sandbox.MaxTimeout.Duration, "sandbox.expiry_interval": c.Sandbox.ExpiryInterval.Duration,
		"sandbox.expiry_call_timeout": c.Sandbox.ExpiryCallTimeout.Duration,
		"sandbox.create_timeout":      c.Sandbox.CreateTimeout.Duration, "apikeys.cache_ttl": c.APIKeys.CacheTTL.Duration,
	} {
		if d <= 0 {
			return bad("%s must be positive", name)
		}
	}
	if w := c.Drain.RequestWait.Duration; w < 0 || w > MaxRequestWait {
		return bad("drain.request_wait (%s) must be within 0 and %s", c.Drain.RequestWait, MaxRequestWait)
	}
	if c.HA.LeaseTTL.Duration < 200*time.Millisecond {
		return bad("ha.lease_ttl (%s) must be at least 200ms", c.HA.LeaseTTL)
	}
	if c.Sandbox.AdoptWindow.Duration < 0 {
		return bad("sandbox.adopt_window must not be negative")
	}
	if c.Nodes.RestartWait.Duration < 0 {
		return bad("nodes.restart_wait must not be negative (0: fail at once)")
	}
	if c.Nodes.UnhealthyAfter.Duration < c.Nodes.HeartbeatInterval.Duration {
		return bad("nodes.unhealthy_after (%s) must be at least nodes.heartbeat_interval (%s)", c.Nodes.UnhealthyAfter, c.Nodes.HeartbeatInterval)
	}
	if c.Nodes.LostAfter.Duration < c.Nodes.UnhealthyAfter.Duration {
		return bad("nodes.lost_after (%s) must be at least nodes.unhealthy_after (%s)", c.Nodes.LostAfter, c.Nodes.UnhealthyAfter)
	}
	if c.Sandbox.DefaultTimeout.Duration > c.Sandbox.MaxTimeout.Duration || c.Sandbox.V1DefaultTimeout.Duration > c.Sandbox.MaxTimeout.Duration {
		return bad("sandbox default timeouts exceed sandbox.max_timeout")
	}
	if c.Sandbox.MilliCPU <= 0 || c.Sandbox.MemoryMiB < 16 {
		return bad("sandbox.milli_cpu must be positive and sandbox.memory_mib at least 16")
	}
	if !versionRE.MatchString(c.Sandbox.EnvdVersion) {
		return bad("sandbox.envd_version %q: want MAJOR.MINOR.PATCH", c.Sandbox.EnvdVersion)
	}
	for alias, id := range c.Templates.Aliases {
		if len(alias) == 0 || len(alias) > 128 {
			return bad("templates.aliases: alias %q: 1-128 characters", alias)
		}
		if err := sandboxid.Validate("template", id); err != nil {
			return bad("templates.aliases.%s: %v", alias, err)
		}
	}
	if c.Templates.StoreDir == "" || !filepath.IsAbs(c.Templates.StoreDir) {
		return bad("templates.store_dir %q: want an absolute path", c.Templates.StoreDir)
	}
	if h := c.Console.AdminPasswordHash; h != "" && !strings.HasPrefix(h, "$2") {
		return bad("console.admin_password_hash: want a bcrypt hash ($2a$/$2b$/$2y$...)")
	}
	if c.API.E2B == "" && c.API.Node == "" && c.API.Socket == "" {
		return bad("every API listener is disabled")
	}
	return nil
}
