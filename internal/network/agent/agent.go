// Package agent is network-agent: it owns every network slot on the node.
// Agent is the in-process API; package agentapi is a thin gRPC adapter
// over it, so tests and cubelet's test environment can run it in-process.
//
// Concurrency: operations on one sandbox are serialised by a per-sandbox
// lock; different sandboxes never wait on each other except for the short
// critical sections of a.mu (maps and the pool). Reconcile excludes every
// other operation (a.opMu).
package agent

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/audit"
	"github.com/cubesandbox/cube/internal/network/dnsfwd"
	"github.com/cubesandbox/cube/internal/network/egress"
	"github.com/cubesandbox/cube/internal/network/ipam"
	"github.com/cubesandbox/cube/internal/network/nft"
	"github.com/cubesandbox/cube/internal/network/nl"
	"github.com/cubesandbox/cube/internal/network/policy"
	"github.com/cubesandbox/cube/internal/network/slot"
	"github.com/cubesandbox/cube/internal/network/slotstore"
)

// Agent is one node's network-agent.
type Agent struct {
	cfg     *Config
	log     *slog.Logger
	store   *slotstore.Store
	space   *ipam.Space
	metrics *metrics
	dns     *dnsfwd.Forwarder // nil when [dns] is off
	egress  *egress.Proxy     // nil when [egress] is off
	audit   *audit.Log

	opMu  sync.RWMutex // held shared by every operation, exclusively by Reconcile
	locks keyedLock    // per sandbox

	mu        sync.Mutex
	slots     map[int]*slotstore.Record // every record in the store
	bySandbox map[string]int
	pool      map[network.Kind][]int // ready slots, oldest first
	filling   map[network.Kind]int   // pooled slots being created

	ready    atomic.Bool
	kick     chan struct{}
	stop     chan struct{}
	stopOnce sync.Once
	fillDone chan struct{}
}

// New validates cfg, opens the store, sets up the host (forwarding, the
// host nftables table), reconciles the store with the kernel and starts
// the pool filler.
func New(ctx context.Context, cfg *Config, log *slog.Logger) (*Agent, error) {
	if log == nil {
		log = slog.Default()
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	// Before anything is written: a refused config leaves nothing behind.
	if err := checkOverlap(cfg); err != nil {
		return nil, err
	}
	for _, d := range []string{cfg.NetnsDir(), cfg.DataDir} {
		if err := os.MkdirAll(d, 0o711); err != nil {
			return nil, err
		}
	}
	space, err := ipam.New(cfg.CIDR())
	if err != nil {
		return nil, err
	}
	st, err := slotstore.Open(cfg.StorePath())
	if err != nil {
		return nil, err
	}
	a := &Agent{
		cfg: cfg, log: log, store: st, space: space, metrics: newMetrics(),
		slots: map[int]*slotstore.Record{}, bySandbox: map[string]int{},
		pool: map[network.Kind][]int{}, filling: map[network.Kind]int{},
		kick: make(chan struct{}, 1), stop: make(chan struct{}), fillDone: make(chan struct{}),
	}
	if a.audit, err = audit.New(cfg.AuditDir(), time.Duration(cfg.Audit.KeepHours)*time.Hour, log); err != nil {
		st.Close()
		return nil, err
	}
	if cfg.DNS.Enabled {
		fc := cfg.DNS.Forwarder()
		fc.Audit = a.audit
		if a.dns, err = dnsfwd.New(fc, log); err != nil {
			st.Close()
			return nil, err
		}
	}
	if cfg.Egress.Enabled {
		if a.egress, err = newEgress(cfg, a.dns, a.audit, log); err != nil {
			st.Close()
			return nil, err
		}
	}
	a.metrics.register(a)
	ok := false
	defer func() {
		if !ok {
			st.Close()
			if a.dns != nil {
				// Reconcile attached the assigned slots.
				a.dns.Close()
			}
			if a.egress != nil {
				a.egress.Close()
			}
		}
	}()
	if err := a.checkIdentity(); err != nil {
		return nil, err
	}
	if err := a.setupHost(); err != nil {
		return nil, err
	}
	sum, err := a.reconcile(ctx)
	if err != nil {
		return nil, fmt.Errorf("reconcile: %w", err)
	}
	log.Info("network-agent reconciled", "adopted", sum.Adopted, "repaired", sum.Repaired,
		"released", sum.Released, "orphans", sum.Orphans, "errors", len(sum.Errors))
	for _, e := range sum.Errors {
		log.Warn("reconcile", "err", e)
	}
	go a.fillLoop()
	a.ready.Store(true)
	ok = true
	return a, nil
}

// checkIdentity refuses to start when the node CIDR or prefix changed
// while slots exist: their addresses and names derive from both.
func (a *Agent) checkIdentity() error {
	recs, err := a.store.List()
	if err != nil {
		return err
	}
	for k, want := range map[string]string{"node_cidr": a.cfg.CIDR().String(), "prefix": a.cfg.Prefix} {
		have, err := a.store.Meta(k)
		if err != nil {
			return err
		}
		if have != "" && have != want && len(recs) > 0 {
			return fmt.Errorf("%s changed from %s to %s while %d slots exist: release them (network-agent --purge) first: %w",
				k, have, want, len(recs), errdefs.ErrFailedPrecondition)
		}
		if err := a.store.SetMeta(k, want); err != nil {
			return err
		}
	}
	return nil
}

// setupHost enables forwarding and installs the host table.
func (a *Agent) setupHost() error {
	if a.cfg.IPForward {
		if err := os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0o644); err != nil {
			return fmt.Errorf("enable ip_forward: %w", err)
		}
	}
	raiseNeighbourTable(a.cfg.CIDR().Bits(), a.log)
	return nft.ApplyHost(nft.Host{Table: a.cfg.Prefix, LinkPrefix: a.linkPrefix(), NodeCIDR: a.cfg.CIDR()})
}

// neighSysctl is where the host's IPv4 neighbour (ARP) table limits are.
const neighSysctl = "/proc/sys/net/ipv4/neigh/default/"

// raiseNeighbourTable makes the host's ARP table hold an entry for every
// slot the node CIDR has: the host reaches each slot's HOSTIP over its
// own veth, one neighbour entry per slot. With the kernel's defaults
// (gc_thresh3 = 1024 entries) the 1025th slot in use finds the table full
// ("neighbor table overflow") and connections to sandboxes stall in SYN
// retransmits; between gc_thresh1 (128) and the others entries of idle
// slots are collected, and their next request waits for ARP again.
// Limits are only raised (gc_thresh1 to the slots, 2 and 3 to two and
// four times that), never lowered; a host where they cannot be written
// (a read-only /proc/sys) keeps its own, logged.
func raiseNeighbourTable(cidrBits int, log *slog.Logger) {
	slots := int64(1) << (32 - cidrBits) / 4
	for name, want := range map[string]int64{"gc_thresh1": slots, "gc_thresh2": 2 * slots, "gc_thresh3": 4 * slots} {
		b, err := os.ReadFile(neighSysctl + name)
		if err != nil {
			log.Warn("neighbour table limit unreadable; slots past it stall", "sysctl", name, "err", err)
			continue
		}
		have, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		if err != nil || have >= want {
			continue
		}
		if err := os.WriteFile(neighSysctl+name, []byte(strconv.FormatInt(want, 10)), 0o644); err != nil {
			log.Warn("cannot raise the neighbour table limit; slots past it stall", "sysctl", name, "have", have, "want", want, "err", err)
		}
	}
}

func (a *Agent) linkPrefix() string { return a.cfg.Prefix + "-" }

// checkOverlap refuses a node CIDR that overlaps an address or route the
// host already has on a link that is not one of ours: slots would shadow
// that network (or it them).
func checkOverlap(cfg *Config) error {
	links, err := nl.Dump(netlink.LinkList)
	if err != nil {
		return err
	}
	names := map[int]string{}
	for _, l := range links {
		names[l.Attrs().Index] = l.Attrs().Name
	}
	ours := func(idx int) bool {
		n, ok := names[idx]
		_, slot := slotOfLink(cfg.Prefix, n)
		return ok && slot
	}
	cidr := cfg.CIDR()
	routes, err := nl.Dump(func() ([]netlink.Route, error) {
		return netlink.RouteListFiltered(netlink.FAMILY_V4, &netlink.Route{Table: 0}, netlink.RT_FILTER_TABLE)
	})
	if err != nil {
		return err
	}
	for _, r := range routes {
		if r.Dst == nil || ours(r.LinkIndex) {
			continue
		}
		p, ok := netip.AddrFromSlice(r.Dst.IP)
		if !ok {
			continue
		}
		bits, _ := r.Dst.Mask.Size()
		if bits == 0 {
			continue // a default route overlaps everything by design
		}
		if rp := netip.PrefixFrom(p.Unmap(), bits); rp.Overlaps(cidr) {
			return fmt.Errorf("node_cidr %s overlaps route %s dev %s: %w", cidr, rp, names[r.LinkIndex], errdefs.ErrInvalidArgument)
		}
	}
	addrs, err := nl.Dump(func() ([]netlink.Addr, error) { return netlink.AddrList(nil, netlink.FAMILY_V4) })
	if err != nil {
		return err
	}
	for _, ad := range addrs {
		if ours(ad.LinkIndex) {
			continue
		}
		if ip, ok := netip.AddrFromSlice(ad.IP); ok && cidr.Contains(ip.Unmap()) {
			return fmt.Errorf("node_cidr %s holds %s, an address of %s: %w", cidr, ip, names[ad.LinkIndex], errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

// slotOfLink returns the slot number of one of this agent's host links or
// namespace pins (<prefix>-<n>).
func (a *Agent) slotOfLink(name string) (int, bool) { return slotOfLink(a.cfg.Prefix, name) }

func slotOfLink(prefix, name string) (int, bool) {
	rest, ok := cutPrefix(name, prefix+"-")
	if !ok {
		return 0, false
	}
	i, err := strconv.Atoi(rest)
	return i, err == nil && strconv.Itoa(i) == rest
}

func cutPrefix(s, p string) (string, bool) {
	if len(s) > len(p) && s[:len(p)] == p {
		return s[len(p):], true
	}
	return "", false
}

// Close stops the pool filler and closes the store. Slots stay: their
// sandboxes keep their network, and a restarted agent adopts them.
func (a *Agent) Close() error {
	a.ready.Store(false)
	a.stopFill()
	if a.dns != nil {
		a.dns.Close()
	}
	if a.egress != nil {
		a.egress.Close()
	}
	a.audit.CloseAll()
	return a.store.Close()
}

// stopFill stops the pool filler and waits for it.
func (a *Agent) stopFill() {
	a.stopOnce.Do(func() { close(a.stop) })
	<-a.fillDone
}

// Purge stops the pool filler, releases every slot (pooled and assigned)
// and removes the host table: what an uninstall or a test's cleanup wants.
func (a *Agent) Purge(ctx context.Context) error {
	a.stopFill()
	a.opMu.Lock()
	defer a.opMu.Unlock()
	a.mu.Lock()
	idxs := make([]int, 0, len(a.slots))
	for i := range a.slots {
		idxs = append(idxs, i)
	}
	a.mu.Unlock()
	// Releases mostly wait for RCU grace periods (link and mount
	// teardown), not CPU: run several at once.
	errs := make([]error, len(idxs)+1)
	sem := make(chan struct{}, 16)
	var wg sync.WaitGroup
	for k, i := range idxs {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			errs[k] = a.releaseSlot(ctx, i)
		})
	}
	wg.Wait()
	errs[len(idxs)] = nft.DeleteTable(-1, a.cfg.Prefix)
	return errors.Join(errs...)
}

// Config returns the configuration the agent runs with.
func (a *Agent) Config() *Config { return a.cfg }

// layout locates a slot's kernel objects.
func (a *Agent) layout(i int, kind network.Kind) slot.Layout {
	addrs, _ := a.space.Addrs(i) // i came from the space
	return slot.Layout{Index: i, Kind: kind, Dir: a.cfg.NetnsDir(), Prefix: a.cfg.Prefix, Addrs: addrs,
		NodeCIDR: a.cfg.CIDR(), Opened: a.cfg.Opened(), DNS: a.dns != nil, ProxyPort: a.proxyPort()}
}

// attachDNS makes the forwarder and the egress proxy serve an assigned
// slot (idempotent; with the slot's current policy, which makes the proxy
// cut open connections the policy no longer allows). fresh: the slot's
// namespace was (re)created, so sockets held for this sandbox, if any,
// are in a namespace that is gone.
func (a *Agent) attachDNS(r *slotstore.Record, fresh bool) error {
	if a.dns == nil || r.SandboxID == "" {
		return nil
	}
	if fresh {
		a.dns.Detach(r.SandboxID)
		if a.egress != nil {
			a.egress.Detach(r.SandboxID)
		}
	}
	ns := a.layout(r.Index, r.Kind).SlotNS()
	if err := a.dns.Attach(dnsfwd.Target{SandboxID: r.SandboxID, NetNS: ns,
		Addr: network.SandboxGateway, Policy: r.Policy}); err != nil {
		return err
	}
	if a.egress != nil {
		return a.egress.Attach(egress.Target{SandboxID: r.SandboxID, NetNS: ns, Addr: network.SandboxGateway, Policy: r.Policy})
	}
	return nil
}

// detachDNS stops serving a sandbox: before its namespace goes, since an
// open socket would keep the namespace alive.
func (a *Agent) detachDNS(id string) {
	if id == "" {
		return
	}
	if a.dns != nil {
		a.dns.Detach(id)
	}
	if a.egress != nil {
		a.egress.Detach(id)
	}
	a.audit.Close(id)
}

// proxyPort is where the egress proxy listens in every slot (0: off).
func (a *Agent) proxyPort() uint16 {
	if a.egress == nil {
		return 0
	}
	return uint16(a.cfg.Egress.Port)
}

// newEgress loads (or makes) the node's egress CA and the upstream roots
// and returns the proxy.
func newEgress(cfg *Config, res *dnsfwd.Forwarder, al *audit.Log, log *slog.Logger) (*egress.Proxy, error) {
	ca, err := egress.LoadOrCreateCA(cfg.EgressCADir())
	if err != nil {
		return nil, err
	}
	var roots *x509.CertPool
	if f := cfg.Egress.UpstreamCA; f != "" {
		pemBytes, err := os.ReadFile(f)
		if err != nil {
			return nil, fmt.Errorf("egress.upstream_ca: %w", err)
		}
		roots = x509.NewCertPool()
		if !roots.AppendCertsFromPEM(pemBytes) {
			return nil, fmt.Errorf("egress.upstream_ca %s: no certificate: %w", f, errdefs.ErrInvalidArgument)
		}
	}
	return egress.New(egress.Config{Port: uint16(cfg.Egress.Port), NodeCIDR: cfg.CIDR(), Opened: cfg.Opened(),
		CA: ca, UpstreamRoots: roots, Audit: al}, res, policy.Blocked(cfg.CIDR()), log), nil
}

// EgressCA is the PEM of the node's egress CA (nil when the proxy is off):
// what sandboxes trust for hosts whose TLS the proxy terminates.
func (a *Agent) EgressCA() []byte {
	if a.egress == nil {
		return nil
	}
	return a.egress.CA()
}

// EgressStats returns the proxy's counters (nil when it is off).
func (a *Agent) EgressStats() *egress.Stats {
	if a.egress == nil {
		return nil
	}
	return &a.egress.Stats
}

// TakeNotable returns the notable egress verdicts (denied, failed, cut)
// since the last call, within the audit log's rate limits, and forgets
// them.
func (a *Agent) TakeNotable() audit.Notable { return a.audit.TakeNotable() }

// AuditPath is the file of a sandbox's audit events.
func (a *Agent) AuditPath(id string) string { return a.audit.Path(id) }

// DNSStats returns the forwarder's counters (nil when it is off).
func (a *Agent) DNSStats() *dnsfwd.Stats {
	if a.dns == nil {
		return nil
	}
	return &a.dns.Stats
}

// view turns a record into the API's Network.
func (a *Agent) view(r *slotstore.Record) *network.Network {
	l := a.layout(r.Index, r.Kind)
	n := &network.Network{
		SandboxID: r.SandboxID, Kind: r.Kind, Slot: r.Index,
		HostIP: l.Addrs.HostIP.String(), GatewayIP: l.Addrs.Gateway.String(), SandboxIP: network.SandboxIP.String(),
		NetNS: l.RuntimeNS(), SlotNetNS: l.SlotNS(), HostLink: l.HostLink(),
		Policy: r.Policy.Clone(), AssignedAt: r.AssignedAt, FromPool: r.FromPool,
	}
	if r.Kind == network.VM {
		n.Tap = network.TapName
	}
	if a.dns != nil {
		n.Resolver = network.SandboxGateway.String()
	}
	if a.egress != nil {
		n.EgressCA = a.egress.CADER()
	}
	return n
}

// keyedLock is a mutex per key, dropped when nobody holds or waits for it.
type keyedLock struct {
	mu sync.Mutex
	m  map[string]*keyedEntry
}

type keyedEntry struct {
	mu   sync.Mutex
	refs int
}

func (k *keyedLock) lock(key string) func() {
	k.mu.Lock()
	if k.m == nil {
		k.m = map[string]*keyedEntry{}
	}
	e := k.m[key]
	if e == nil {
		e = &keyedEntry{}
		k.m[key] = e
	}
	e.refs++
	k.mu.Unlock()
	e.mu.Lock()
	return func() {
		e.mu.Unlock()
		k.mu.Lock()
		if e.refs--; e.refs == 0 {
			delete(k.m, key)
		}
		k.mu.Unlock()
	}
}

// poolPolicy is what a slot holds until a sandbox gets it: nothing leaves.
// Its sets are all empty, so assigning a pooled slot only adds elements.
var poolPolicy = policy.DenyAll()
