package workflow

import (
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics is the engine's Prometheus instrumentation; a nil *metrics records
// nothing.
type metrics struct {
	action   *prometheus.HistogramVec // flow, action, phase, outcome
	flow     *prometheus.HistogramVec // flow, outcome
	rejected *prometheus.CounterVec   // flow
	inflight *prometheus.GaugeVec     // flow
}

// durationBuckets spans 1ms to ~65s, where sandbox actions live.
var durationBuckets = prometheus.ExponentialBuckets(0.001, 2, 17)

func newMetrics(r prometheus.Registerer, ns string) (*metrics, error) {
	m := &metrics{
		action: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: ns, Name: "action_duration_seconds",
			Help:    "Duration of one workflow action's do or undo.",
			Buckets: durationBuckets,
		}, []string{"flow", "action", "phase", "outcome"}),
		flow: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: ns, Name: "flow_duration_seconds",
			Help:    "Duration of a whole workflow run, undo included.",
			Buckets: durationBuckets,
		}, []string{"flow", "outcome"}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "flow_rejected_total",
			Help: "Runs refused because the flow was at its concurrency limit.",
		}, []string{"flow"}),
		inflight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: ns, Name: "flow_inflight",
			Help: "Runs of the flow in progress.",
		}, []string{"flow"}),
	}
	var err error
	if m.action, err = register(r, m.action); err != nil {
		return nil, err
	}
	if m.flow, err = register(r, m.flow); err != nil {
		return nil, err
	}
	if m.rejected, err = register(r, m.rejected); err != nil {
		return nil, err
	}
	if m.inflight, err = register(r, m.inflight); err != nil {
		return nil, err
	}
	return m, nil
}

// register registers c, or returns the identical collector already there so
// that several engines may share one registry.
func register[C prometheus.Collector](r prometheus.Registerer, c C) (C, error) {
	if err := r.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(C); ok {
				return existing, nil
			}
		}
		return c, err
	}
	return c, nil
}

func outcome(err error) string {
	if err != nil {
		return "error"
	}
	return "ok"
}

func (m *metrics) observeAction(flow, action, phase string, d time.Duration, err error) {
	if m != nil {
		m.action.WithLabelValues(flow, action, phase, outcome(err)).Observe(d.Seconds())
	}
}

func (m *metrics) observeFlow(flow string, d time.Duration, err error) {
	if m != nil {
		m.flow.WithLabelValues(flow, outcome(err)).Observe(d.Seconds())
	}
}

func (m *metrics) reject(flow string) {
	if m != nil {
		m.rejected.WithLabelValues(flow).Inc()
	}
}

func (m *metrics) addInflight(flow string, delta float64) {
	if m != nil {
		m.inflight.WithLabelValues(flow).Add(delta)
	}
}
