package usage

import "github.com/prometheus/client_golang/prometheus"

// Collector exports each sandbox's newest sample as Prometheus series
// labelled sandbox_id. It reads the rings at scrape time, so a sandbox's
// series exist exactly as long as its ring: they go with the sandbox.
type Collector struct{ s *Sampler }

var _ prometheus.Collector = (*Collector)(nil)

// Collector returns the sampler's Prometheus collector; it exports
// nothing unless the config's Series is set.
func (s *Sampler) Collector() *Collector { return &Collector{s: s} }

var (
	label     = []string{"sandbox_id"}
	cpuDesc   = prometheus.NewDesc("cubelet_sandbox_cpu_seconds_total", "CPU time the sandbox has used.", label, nil)
	memDesc   = prometheus.NewDesc("cubelet_sandbox_memory_bytes", "Memory charged to the sandbox's cgroup.", label, nil)
	rssDesc   = prometheus.NewDesc("cubelet_sandbox_memory_rss_bytes", "Anonymous memory of the sandbox.", label, nil)
	cacheDesc = prometheus.NewDesc("cubelet_sandbox_memory_cache_bytes", "Page cache charged to the sandbox.", label, nil)
	limDesc   = prometheus.NewDesc("cubelet_sandbox_memory_limit_bytes", "The sandbox's memory limit (0 = none).", label, nil)
	pidsDesc  = prometheus.NewDesc("cubelet_sandbox_tasks", "Tasks (processes and threads) in the sandbox's cgroup.", label, nil)
	diskDesc  = prometheus.NewDesc("cubelet_sandbox_disk_used_bytes", "Disk space the sandbox uses.", label, nil)
	rxDesc    = prometheus.NewDesc("cubelet_sandbox_network_receive_bytes_total", "Bytes the sandbox received through its slot.", label, nil)
	txDesc    = prometheus.NewDesc("cubelet_sandbox_network_transmit_bytes_total", "Bytes the sandbox sent through its slot.", label, nil)
)

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{cpuDesc, memDesc, rssDesc, cacheDesc, limDesc, pidsDesc, diskDesc, rxDesc, txDesc} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	if !c.s.cfg.Series {
		return
	}
	for id, m := range c.s.Latest() {
		g := func(d *prometheus.Desc, t prometheus.ValueType, v float64) {
			ch <- prometheus.MustNewConstMetric(d, t, v, id)
		}
		g(cpuDesc, prometheus.CounterValue, m.CPU.Seconds())
		g(memDesc, prometheus.GaugeValue, float64(m.MemUsed))
		g(rssDesc, prometheus.GaugeValue, float64(m.MemRSS))
		g(cacheDesc, prometheus.GaugeValue, float64(m.MemCache))
		g(limDesc, prometheus.GaugeValue, float64(m.MemLimit))
		g(pidsDesc, prometheus.GaugeValue, float64(m.Pids))
		g(diskDesc, prometheus.GaugeValue, float64(m.DiskUsed))
		g(rxDesc, prometheus.CounterValue, float64(m.NetRx))
		g(txDesc, prometheus.CounterValue, float64(m.NetTx))
	}
}
