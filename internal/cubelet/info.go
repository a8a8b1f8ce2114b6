package cubelet

import (
	"context"
	"os"
	goruntime "runtime"
	"sort"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

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
		StorageMode: s.node.pool.Mode(), StorageDir: s.node.pool.Dir(),
		CPUs: goruntime.NumCPU(), SandboxesByState: map[lifecycle.State]int{},
	}
	for name, d := range s.node.drivers {
		ri := RuntimeInfo{Name: name, Capabilities: d.Capabilities()}
		if ds, ok := d.(interface{ Describe() string }); ok {
			ri.Detail = ds.Describe()
		}
		info.Runtimes = append(info.Runtimes, ri)
	}
	sort.Slice(info.Runtimes, func(i, j int) bool { return info.Runtimes[i].Name < info.Runtimes[j].Name })
	var st unix.Statfs_t
	if unix.Statfs(s.node.pool.Dir(), &st) == nil {
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

// Condition is one health check.
type Condition struct {
	Type    string
	OK      bool
	Message string
}

// Health checks the store, the storage pool and each runtime.
func (s *Service) Health(ctx context.Context) (bool, []Condition) {
	var conds []Condition
	add := func(typ string, err error) {
		c := Condition{Type: typ, OK: err == nil}
		if err != nil {
			c.Message = err.Error()
		}
		conds = append(conds, c)
	}
	_, err := s.store.Meta("node_id")
	add("store", err)
	_, err = os.Stat(s.node.pool.Dir())
	add("storage", err)
	for name, d := range s.node.drivers {
		_, err := d.List(ctx)
		add("runtime/"+name, err)
	}
	if err, on := s.networkHealth(ctx); on {
		add("network-agent", err)
	}
	ok := true
	for _, c := range conds {
		ok = ok && c.OK
	}
	return ok, conds
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

var sandboxesDesc = prometheus.NewDesc("cubelet_sandboxes", "Sandboxes on this node by state.", []string{"state"}, nil)

func (c *stateCollector) Describe(ch chan<- *prometheus.Desc) { ch <- sandboxesDesc }

func (c *stateCollector) Collect(ch chan<- prometheus.Metric) {
	counts := map[lifecycle.State]int{}
	c.s.mu.Lock()
	for _, e := range c.s.boxes {
		counts[e.rec.Load().State]++
	}
	c.s.mu.Unlock()
	for _, st := range lifecycle.All {
		ch <- prometheus.MustNewConstMetric(sandboxesDesc, prometheus.GaugeValue, float64(counts[st]), string(st))
	}
}
