// Package vminit is what cube-agent does first as PID 1 of a VM (--vm):
// the work runc does for a container — mount the kernel file systems, set
// the hostname, bring up the network — driven by the cube.* parameters the
// host put on the kernel command line (vmguest.Cmdline writes them).
package vminit

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"regexp"
	"strings"
	"sync"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/errdefs"
)

// DefaultPath is the PATH processes get: the kernel hands init none that
// suits a sandbox.
const DefaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// Config is what the kernel command line asks for.
type Config struct {
	Hostname string
	Addr     netip.Prefix // eth0's address; invalid: leave eth0 down
	Gateway  netip.Addr   // default route; invalid: none
	// TokenHash is the verifier of the sandbox's access token
	// (agentproto.TokenHashParam), "" when it has none: only the hash
	// goes on the command line, which anything in the guest can read.
	TokenHash string
	// Resolver is the nameserver for /etc/resolv.conf
	// (agentproto.ResolverParam); invalid: leave the file alone.
	Resolver netip.Addr
	// EgressCA is a CA certificate (DER) for the trust store
	// (agentproto.EgressCAParam); nil: none.
	EgressCA []byte
}

// hostnameRE is compiled on first use: its bounded repeats make an 86 KiB
// program, which every container agent (which never parses kernel
// parameters) would otherwise build at start and keep for its life.
var hostnameRE = sync.OnceValue(func() *regexp.Regexp {
	return regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$`)
})

// ParseCmdline reads the cube.* parameters from a kernel command line.
func ParseCmdline(cmdline string) (Config, error) {
	var c Config
	for _, f := range strings.Fields(cmdline) {
		k, v, _ := strings.Cut(f, "=")
		var err error
		switch k {
		case "cube.hostname":
			if len(v) > 253 || !hostnameRE().MatchString(v) {
				err = fmt.Errorf("vminit: cube.hostname=%q: not a hostname: %w", v, errdefs.ErrInvalidArgument)
			}
			c.Hostname = v
		case "cube.ip":
			c.Addr, err = netip.ParsePrefix(v)
			if err == nil && !c.Addr.Addr().Is4() {
				err = errors.New("IPv4 only")
			}
			if err != nil {
				err = fmt.Errorf("vminit: cube.ip=%q: %v: %w", v, err, errdefs.ErrInvalidArgument)
			}
		case agentproto.TokenHashParam:
			c.TokenHash = v
		case agentproto.ResolverParam:
			c.Resolver, err = netip.ParseAddr(v)
			if err != nil {
				err = fmt.Errorf("vminit: %s=%q: %v: %w", k, v, err, errdefs.ErrInvalidArgument)
			}
		case agentproto.EgressCAParam:
			c.EgressCA, err = agentproto.DecodeCA(v)
			if err != nil {
				err = fmt.Errorf("vminit: %s: %v: %w", k, err, errdefs.ErrInvalidArgument)
			}
		case "cube.gw":
			c.Gateway, err = netip.ParseAddr(v)
			if err != nil {
				err = fmt.Errorf("vminit: cube.gw=%q: %v: %w", v, err, errdefs.ErrInvalidArgument)
			}
		}
		if err != nil {
			return Config{}, err
		}
	}
	if c.Gateway.IsValid() && !c.Addr.IsValid() {
		return Config{}, fmt.Errorf("vminit: cube.gw without cube.ip: %w", errdefs.ErrInvalidArgument)
	}
	return c, nil
}

type mount struct {
	target, fstype, source string
	flags                  uintptr
	data                   string
	optional               bool // a kernel without it still boots a usable sandbox
}

// mounts is what a sandbox expects to find, as runc sets it up; /tmp stays
// on the root disk, as in the runc and gVisor runtimes, so disk snapshots
// keep it.
var mounts = []mount{
	{"/proc", "proc", "proc", unix.MS_NOSUID | unix.MS_NOEXEC | unix.MS_NODEV, "", false},
	{"/sys", "sysfs", "sysfs", unix.MS_NOSUID | unix.MS_NOEXEC | unix.MS_NODEV, "", false},
	{"/dev", "devtmpfs", "devtmpfs", unix.MS_NOSUID, "mode=0755", false},
	{"/dev/pts", "devpts", "devpts", unix.MS_NOSUID | unix.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5", false},
	{"/dev/shm", "tmpfs", "shm", unix.MS_NOSUID | unix.MS_NOEXEC | unix.MS_NODEV, "mode=1777", false},
	{"/run", "tmpfs", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=0755", false},
	{"/sys/fs/cgroup", "cgroup2", "cgroup2", unix.MS_NOSUID | unix.MS_NOEXEC | unix.MS_NODEV, "", true},
}

// Setup prepares the VM for the agent. It must run as PID 1, before the
// agent serves.
func Setup(log *slog.Logger) (Config, error) {
	if os.Getpid() != 1 {
		return Config{}, fmt.Errorf("vminit: --vm needs to run as PID 1 of a VM: %w", errdefs.ErrFailedPrecondition)
	}
	if err := mountAll(log); err != nil {
		return Config{}, err
	}
	if err := os.MkdirAll("/tmp", 0o777); err == nil {
		_ = os.Chmod("/tmp", 0o777|os.ModeSticky)
	}
	_ = os.Symlink("/proc/self/fd", "/dev/fd")
	_ = os.Symlink("pts/ptmx", "/dev/ptmx")
	cmdline, err := os.ReadFile("/proc/cmdline")
	if err != nil {
		return Config{}, fmt.Errorf("vminit: %w", err)
	}
	cfg, err := ParseCmdline(string(cmdline))
	if err != nil {
		return Config{}, err
	}
	os.Clearenv()
	os.Setenv("PATH", DefaultPath)
	if cfg.Hostname != "" {
		if err := unix.Sethostname([]byte(cfg.Hostname)); err != nil {
			return Config{}, fmt.Errorf("vminit: sethostname: %w", err)
		}
	}
	if err := Network(cfg); err != nil {
		return Config{}, err
	}
	log.Info("vm init done", "hostname", cfg.Hostname, "addr", cfg.Addr, "gateway", cfg.Gateway)
	return cfg, nil
}

func mountAll(log *slog.Logger) error {
	for _, m := range mounts {
		if err := os.MkdirAll(m.target, 0o755); err != nil && !m.optional {
			return fmt.Errorf("vminit: mkdir %s: %w", m.target, err)
		}
		if err := unix.Mount(m.source, m.target, m.fstype, m.flags, m.data); err != nil {
			if m.optional {
				log.Warn("vminit: optional mount failed", "target", m.target, "error", err)
				continue
			}
			return fmt.Errorf("vminit: mount %s on %s: %w", m.fstype, m.target, err)
		}
	}
	return nil
}

// Network brings up lo and, when cfg has an address, the first ethernet
// link (eth0) with it and the default route.
func Network(cfg Config) error {
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("vminit: lo: %w", err)
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		return fmt.Errorf("vminit: lo up: %w", err)
	}
	if !cfg.Addr.IsValid() {
		return nil
	}
	eth, err := netlink.LinkByName("eth0")
	if err != nil {
		return fmt.Errorf("vminit: eth0 (is the virtio-net device attached?): %w", err)
	}
	addr := &netlink.Addr{IPNet: &net.IPNet{
		IP: cfg.Addr.Addr().AsSlice(), Mask: net.CIDRMask(cfg.Addr.Bits(), 32)}}
	if err := netlink.AddrReplace(eth, addr); err != nil {
		return fmt.Errorf("vminit: eth0 address %s: %w", cfg.Addr, err)
	}
	if err := netlink.LinkSetUp(eth); err != nil {
		return fmt.Errorf("vminit: eth0 up: %w", err)
	}
	if cfg.Gateway.IsValid() {
		r := &netlink.Route{LinkIndex: eth.Attrs().Index, Gw: cfg.Gateway.AsSlice()}
		if err := netlink.RouteReplace(r); err != nil {
			return fmt.Errorf("vminit: default route via %s: %w", cfg.Gateway, err)
		}
	}
	return nil
}
