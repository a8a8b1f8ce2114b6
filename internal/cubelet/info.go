package cubelet

import (
	"context"
	"os"
	goruntime "runtime"
	"sort"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/types/known/timestamppb"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/cubelet/masterlink"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// Version is set at build time (-ldflags -X).
var Version = "dev"

// RuntimeInfo is one runtime driver the node has.
type RuntimeInfo struct {
	Name string
	runtime.Capabilities
	// Detail is what the driver says of itself (accel=tcg, platform=ptrace).
	Detail string
}

// NodeInfo describes the node for `cubecli node info` and the master.
type NodeInfo struct {
	NodeID, Hostname, Version string
	Runtimes                  []RuntimeInfo
	StorageMode, StorageDir   string
	StorageTotal, StorageFree int64
	CPUs                      int
	MemoryBytes               int64
	SandboxesByState          map[lifecycle.State]int
	Templates                 int
}

// Info reports the node's identity, capacity and usage.
func (s *Service) Info(ctx context.Context) (*NodeInfo, error) {
	host, _ := os.Hostname()
	info := &NodeInfo{
		NodeID: s.cfg.Node.ID, Hostname: host, Version: Version,
		StorageMode: s.node.Pool.Mode(), StorageDir: s.node.Pool.Dir(),
		CPUs: goruntime.NumCPU(), SandboxesByState: map[lifecycle.State]int{},
	}
	for name, d := range s.node.Drivers {
		ri := RuntimeInfo{Name: name, Capabilities: d.Capabilities()}
		if ds, ok := d.(runtime.Describer); ok {
			ri.Detail = ds.Describe()
		}
		info.Runtimes = append(info.Runtimes, ri)
	}
	sort.Slice(info.Runtimes, func(i, j int) bool { return info.Runtimes[i].Name < info.Runtimes[j].Name })
	var st unix.Statfs_t
	if unix.Statfs(s.node.Pool.Dir(), &st) == nil {
		info.StorageTotal = int64(st.Blocks) * st.Bsize
		info.StorageFree = int64(st.Bavail) * st.Bsize
	}
	var si unix.Sysinfo_t
	if unix.Sysinfo(&si) == nil {
		info.MemoryBytes = int64(si.Totalram) * int64(si.Unit)
	}
	recs, _ := s.List(ctx, ListFilter{})
	for _, r := range recs {
		info.SandboxesByState[r.State]++
	}
	tmpls, _ := s.store.ListTemplates()
	info.Templates = len(tmpls)
	return info, nil
}

func sortRecords(recs []*sandbox.Record) {
	sort.Slice(recs, func(i, j int) bool {
		if recs[i].CreatedAt.Equal(recs[j].CreatedAt) {
			return recs[i].ID < recs[j].ID
		}
		return recs[i].CreatedAt.Before(recs[j].CreatedAt)
	})
}

// stateCollector exports the number of sandboxes per state at scrape time.
type stateCollector struct{ s *Service }

var _ prometheus.Collector = (*stateCollector)(nil)

var sandboxesDesc = prometheus.NewDesc("cubelet_sandboxes", "Sandboxes on this node by state.", []string{"state"}, nil)

func (c *stateCollector) Describe(ch chan<- *prometheus.Desc) { ch <- sandboxesDesc }

func (c *stateCollector) Collect(ch chan<- prometheus.Metric) {
	counts := map[lifecycle.State]int{}
	c.s.mu.Lock()
	for _, e := range c.s.boxes {
		if r := e.rec.Load(); !pooled(r) {
			counts[r.State]++
		}
	}
	c.s.mu.Unlock()
	for _, st := range lifecycle.All {
		ch <- prometheus.MustNewConstMetric(sandboxesDesc, prometheus.GaugeValue, float64(counts[st]), string(st))
	}
}

// NodeReport is what the node tells cubemaster: identity, capacity, usage,
// templates and health.
func (s *Service) NodeReport(ctx context.Context) *masterpb.NodeReport {
	r := &masterpb.NodeReport{
		NodeId: s.cfg.Node.ID, Address: masterlink.Advertise(s.cfg), Version: Version,
		DataAddress:    masterlink.AdvertiseData(s.cfg, s.DataAddress()),
		DefaultRuntime: s.cfg.Node.DefaultRuntime,
		MaxMilliCpu:    s.cfg.Sandbox.MaxMilliCPU, MaxMemoryMib: s.cfg.Sandbox.MaxMemoryMiB,
		SandboxesByState: map[string]int32{}, SandboxesByTemplate: map[string]int32{},
	}
	if b, err := os.ReadFile("/proc/sys/kernel/random/boot_id"); err == nil {
		r.BootId = strings.TrimSpace(string(b))
	}
	r.PidNamespace, _ = os.Readlink("/proc/self/ns/pid")
	if info, err := s.Info(ctx); err == nil {
		r.Hostname, r.Cpus, r.MemoryBytes = info.Hostname, int32(info.CPUs), info.MemoryBytes
		r.StorageTotalBytes, r.StorageFreeBytes = info.StorageTotal, info.StorageFree
		for _, rt := range info.Runtimes {
			r.Runtimes = append(r.Runtimes, &cubeletpb.RuntimeInfo{Name: rt.Name, Pause: rt.Pause, Checkpoint: rt.Checkpoint, Restore: rt.Restore})
		}
	}
	for name, d := range s.node.Drivers {
		if mib := overheadMiB(d); mib > 0 {
			if r.MemoryOverheadMib == nil {
				r.MemoryOverheadMib = map[string]int64{}
			}
			r.MemoryOverheadMib[name] = mib
		}
	}
	recs, at := s.listAt(ListFilter{})
	r.GeneratedAt = timestamppb.New(at)
	for _, rec := range recs {
		if rec.State == lifecycle.Failed {
			r.Dead = append(r.Dead, &masterpb.DeadSandbox{SandboxId: rec.ID, Reason: rec.Error, DiedAt: timestamppb.New(rec.UpdatedAt)})
		}
		r.SandboxesByState[string(rec.State)]++
		if rec.State == lifecycle.Destroyed || rec.State == lifecycle.Failed {
			continue // holds nothing (a failed sandbox was released)
		}
		r.SandboxesByTemplate[rec.TemplateID]++
		r.AllocatedMilliCpu += rec.Resources.MilliCPU
		r.AllocatedMemoryMib += rec.Resources.MemoryMiB + overheadMiB(s.node.Drivers[rec.Runtime])
	}
	if tmpls, err := s.store.ListTemplates(); err == nil {
		for _, t := range tmpls {
			r.Templates = append(r.Templates, &masterpb.TemplateRef{
				Id: t.ID, Digest: t.Digest, SizeBytes: t.SizeBytes, CreatedAt: timestamppb.New(t.CreatedAt),
				Runtime: t.Runtime, Warm: t.WarmSnapshotID != "", Pool: int32(s.PoolReady(t.ID)),
			})
		}
		sort.Slice(r.Templates, func(i, j int) bool { return r.Templates[i].Id < r.Templates[j].Id })
	}
	ok, conds := s.Health(ctx)
	r.Ok = ok
	r.Busy, r.BusyReason = s.busy(conds)
	for _, c := range conds {
		r.Conditions = append(r.Conditions, &cubeletpb.Condition{Type: c.Type, Ok: c.OK, Message: c.Message})
	}
	s.egressVerdicts(ctx, r, recs)
	return r
}

// egressVerdicts adds network-agent's notable egress verdicts since the
// last report to r, under the sandboxes' IDs (the agent knows their slots
// by host key). Best effort: a report that does not reach the master
// loses them; the node's audit files keep every event.
func (s *Service) egressVerdicts(ctx context.Context, r *masterpb.NodeReport, recs []*sandbox.Record) {
	resp, err := s.node.Net.TakeEgressVerdicts(ctx)
	if err != nil || resp == nil {
		if err != nil {
			s.log.Debug("egress verdicts", "err", err)
		}
		return
	}
	ids := make(map[string]string, len(recs))
	for _, rec := range recs {
		ids[rec.HostKey()] = rec.ID
	}
	for _, v := range resp.Verdicts {
		id, ok := ids[v.SandboxId]
		if !ok {
			continue // a pooled slot's or a released sandbox's
		}
		r.EgressVerdicts = append(r.EgressVerdicts, &masterpb.EgressVerdict{SandboxId: id, Time: v.Time, Kind: v.Kind,
			Verdict: v.Verdict, Name: v.Name, Addr: v.Addr, Rule: v.Rule, Reason: v.Reason})
	}
	for key, n := range resp.Suppressed {
		if id, ok := ids[key]; ok {
			if r.EgressSuppressed == nil {
				r.EgressSuppressed = map[string]int32{}
			}
			r.EgressSuppressed[id] += n
		}
	}
}

// memoryOverhead is a driver whose sandboxes' cgroups get a fixed amount
// of memory above the sandbox's limit (gVisor: the sentry overhead,
// docs/gvisor.md).
type memoryOverhead interface{ MemoryOverhead() int64 }

// overheadMiB is the memory, in MiB rounded up, a sandbox of driver d may
// hold above its limit. The node counts it in the memory it reports as
// allocated, which the master's placement adds up.
func overheadMiB(d runtime.Driver) int64 {
	if o, ok := d.(memoryOverhead); ok {
		return (o.MemoryOverhead() + 1<<20 - 1) >> 20
	}
	return 0
}
