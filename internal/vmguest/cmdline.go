package vmguest

import (
	"net/netip"
	"strings"

	"github.com/cubesandbox/cube/internal/agentproto"
)

// NetConfig is the guest's eth0 address and default route.
type NetConfig struct {
	Addr    netip.Prefix // e.g. 169.254.0.21/30
	Gateway netip.Addr
}

// CmdlineOptions select the kernel command line's variable parts.
type CmdlineOptions struct {
	TCG      bool // no KVM: the TSC and timer checks are unreliable and slow
	Hostname string
	Net      *NetConfig
	// TokenHash is the verifier of the sandbox's agent access token
	// (agentproto.TokenHashParam), never the token: /proc/cmdline is
	// readable by every process in the guest.
	TokenHash string
	// Resolver is the nameserver the agent writes into the guest's
	// /etc/resolv.conf (agentproto.ResolverParam); invalid: none.
	Resolver netip.Addr
	// EgressCA is a CA certificate (DER) the agent adds to the guest's
	// trust store (agentproto.EgressCAParam); nil: none.
	EgressCA []byte
	Extra    []string
}

// baseCmdline is what every guest boots with; docs/vm-guest.md says why.
var baseCmdline = []string{
	"console=ttyS0", "root=/dev/vda", "rw", "rootfstype=ext4",
	"panic=-1", "reboot=k", "quiet", "loglevel=4",
	"pci=off", "8250.nr_uarts=1", "i8042.noaux", "i8042.nomux", "i8042.dumbkbd",
	"cryptomgr.notests", "random.trust_cpu=on", "nomodeset",
}

// TCGTSCParam gives a TCG guest its TSC frequency instead of having the
// kernel measure it against the PIT. Every TCG guest runs under QEMU's
// -icount, where the TSC counts virtual nanoseconds: 1 GHz exactly. The
// measurement fails now and then on a loaded host (the vCPU thread is
// descheduled mid-measurement); the kernel then marks the TSC unstable
// and calibrates its delay loop by waiting for a jiffy, but on microvm
// no timer interrupt is routed yet at that point: it spins for good,
// before it prints anything at loglevel 4, while QEMU runs on.
const TCGTSCParam = "tsc_early_khz=1000000"

// Cmdline renders the kernel command line, including the cube.* values
// cube-agent's VM mode reads from /proc/cmdline.
func Cmdline(o CmdlineOptions) string {
	args := append([]string(nil), baseCmdline...)
	if o.TCG {
		args = append(args, "tsc=reliable", "no_timer_check", TCGTSCParam)
	}
	if o.Hostname != "" {
		args = append(args, "cube.hostname="+o.Hostname)
	}
	if o.Net != nil {
		args = append(args, "cube.ip="+o.Net.Addr.String())
		if o.Net.Gateway.IsValid() {
			args = append(args, "cube.gw="+o.Net.Gateway.String())
		}
	}
	if o.TokenHash != "" {
		args = append(args, agentproto.TokenHashParam+"="+o.TokenHash)
	}
	if o.Resolver.IsValid() {
		args = append(args, agentproto.ResolverParam+"="+o.Resolver.String())
	}
	if len(o.EgressCA) > 0 {
		args = append(args, agentproto.EgressCAParam+"="+agentproto.EncodeCA(o.EgressCA))
	}
	args = append(args, o.Extra...)
	return strings.Join(args, " ")
}
