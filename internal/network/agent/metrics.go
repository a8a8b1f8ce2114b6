package agent

import (
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/slotstore"
)

type metrics struct {
	reg       *prometheus.Registry
	ensure    *prometheus.HistogramVec
	ops       *prometheus.HistogramVec
	errors    *prometheus.CounterVec
	reconcile *prometheus.CounterVec
}

var buckets = []float64{.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5}

func newMetrics() *metrics {
	return &metrics{
		reg: prometheus.NewRegistry(),
		ensure: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "network_agent_ensure_seconds", Help: "EnsureNetwork latency by where the slot came from (pool, cold, existing).", Buckets: buckets,
		}, []string{"source"}),
		ops: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "network_agent_operation_seconds", Help: "Latency of other slot operations.", Buckets: buckets,
		}, []string{"op"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "network_agent_errors_total", Help: "Failed slot operations.",
		}, []string{"op"}),
		reconcile: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "network_agent_reconciled_slots_total", Help: "Slots and orphans handled by reconcile, by outcome.",
		}, []string{"outcome"}),
	}
}

func (m *metrics) register(a *Agent) {
	m.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		m.ensure, m.ops, m.errors, m.reconcile, &slotCollector{a: a})
	if a.egress != nil {
		es := &a.egress.Stats
		for verdict, c := range map[string]*atomic.Uint64{"allowed": &es.Allowed, "denied": &es.Denied,
			"cut": &es.Cut, "failed": &es.Failed} {
			m.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
				Name: "network_agent_egress_connections_total", Help: "Connections through the egress proxy, by verdict (cut: closed by a policy update).",
				ConstLabels: prometheus.Labels{"verdict": verdict},
			}, func() float64 { return float64(c.Load()) }))
		}
		m.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "network_agent_egress_terminated_total", Help: "Allowed connections whose TLS the proxy terminated to inject credentials.",
		}, func() float64 { return float64(es.Terminated.Load()) }))
	}
	if a.dns == nil {
		return
	}
	st := &a.dns.Stats
	for verdict, c := range map[string]*atomic.Uint64{"answered": &st.Answered, "refused": &st.Refused,
		"limited": &st.Limited, "failed": &st.Failed} {
		m.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "network_agent_dns_queries_total", Help: "Sandbox DNS queries, by verdict.",
			ConstLabels: prometheus.Labels{"verdict": verdict},
		}, func() float64 { return float64(c.Load()) }))
	}
	m.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "network_agent_dns_resolved_addresses_total", Help: "Addresses added to sandboxes' resolved sets for allowed domains.",
	}, func() float64 { return float64(st.Added.Load()) }))
}

func (m *metrics) observeEnsure(source string, start time.Time, err error) {
	if err != nil {
		m.errors.WithLabelValues("ensure").Inc()
		return
	}
	m.ensure.WithLabelValues(source).Observe(time.Since(start).Seconds())
}

func (m *metrics) observe(op string, start time.Time, err error) {
	if err != nil {
		m.errors.WithLabelValues(op).Inc()
		return
	}
	m.ops.WithLabelValues(op).Observe(time.Since(start).Seconds())
}

func (m *metrics) reconciled(s Summary) {
	m.reconcile.WithLabelValues("adopted").Add(float64(s.Adopted))
	m.reconcile.WithLabelValues("repaired").Add(float64(s.Repaired))
	m.reconcile.WithLabelValues("released").Add(float64(s.Released))
	m.reconcile.WithLabelValues("orphan").Add(float64(s.Orphans))
	m.reconcile.WithLabelValues("error").Add(float64(len(s.Errors)))
}

// Metrics is the registry served on /metrics.
func (a *Agent) Metrics() *prometheus.Registry { return a.metrics.reg }

// slotCollector exports slot counts at scrape time.
type slotCollector struct{ a *Agent }

var (
	slotsDesc = prometheus.NewDesc("network_agent_slots", "Slots by state.", []string{"state"}, nil)
	poolDesc  = prometheus.NewDesc("network_agent_pool_ready", "Ready pooled slots by kind.", []string{"kind"}, nil)
	freeDesc  = prometheus.NewDesc("network_agent_addresses_free", "Slot blocks left in the node CIDR.", nil, nil)
)

func (c *slotCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- slotsDesc
	ch <- poolDesc
	ch <- freeDesc
}

func (c *slotCollector) Collect(ch chan<- prometheus.Metric) {
	a := c.a
	counts := map[slotstore.State]int{}
	a.mu.Lock()
	for _, r := range a.slots {
		counts[r.State]++
	}
	pool := map[network.Kind]int{network.Container: len(a.pool[network.Container]), network.VM: len(a.pool[network.VM])}
	space := a.space
	a.mu.Unlock()
	for _, st := range []slotstore.State{slotstore.Creating, slotstore.Ready, slotstore.Assigned, slotstore.Releasing} {
		ch <- prometheus.MustNewConstMetric(slotsDesc, prometheus.GaugeValue, float64(counts[st]), string(st))
	}
	for k, n := range pool {
		ch <- prometheus.MustNewConstMetric(poolDesc, prometheus.GaugeValue, float64(n), string(k))
	}
	ch <- prometheus.MustNewConstMetric(freeDesc, prometheus.GaugeValue, float64(space.Size()-space.InUse()))
}
