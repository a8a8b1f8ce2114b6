package workflow

import (
	"context"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
)

func TestMetrics(t *testing.T) {
	prom := prometheus.NewPedanticRegistry()
	reg := newRegistry(t, []string{"a"}, &fake{name: "b", create: func(context.Context, *task) error { return errBoom }})
	e := newEngine(t, reg, Config{"create": {Steps: [][]string{{"a"}, {"b"}}}, "destroy": {Steps: [][]string{{"a"}}}},
		WithMetrics(prom, "cube"))
	// A second engine on the same registry shares the collectors.
	if _, err := New(reg, testVerbs(), Config{}, WithMetrics(prom, "cube")); err != nil {
		t.Fatalf("second engine on one registry: %v", err)
	}
	ctx := context.Background()
	if _, err := e.Run(ctx, "create", &task{}); err == nil {
		t.Fatal("create did not fail")
	}
	if _, err := e.Run(ctx, "destroy", &task{}); err != nil {
		t.Fatal(err)
	}

	if err := testutil.GatherAndCompare(prom, strings.NewReader(`
# HELP cube_flow_inflight Runs of the flow in progress.
# TYPE cube_flow_inflight gauge
cube_flow_inflight{flow="create"} 0
cube_flow_inflight{flow="destroy"} 0
`), "cube_flow_inflight"); err != nil {
		t.Fatal(err)
	}
	mfs, err := prom.Gather()
	if err != nil {
		t.Fatal(err)
	}
	counts := map[string]uint64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			if h := m.GetHistogram(); h != nil {
				counts[mf.GetName()+"{"+labels(m)+"}"] = h.GetSampleCount()
			}
		}
	}
	want := map[string]uint64{
		"cube_action_duration_seconds{action=a,flow=create,outcome=ok,phase=do}":    1,
		"cube_action_duration_seconds{action=b,flow=create,outcome=error,phase=do}": 1,
		"cube_action_duration_seconds{action=b,flow=create,outcome=ok,phase=undo}":  1,
		"cube_action_duration_seconds{action=a,flow=create,outcome=ok,phase=undo}":  1,
		"cube_action_duration_seconds{action=a,flow=destroy,outcome=ok,phase=do}":   1,
		"cube_flow_duration_seconds{flow=create,outcome=error}":                     1,
		"cube_flow_duration_seconds{flow=destroy,outcome=ok}":                       1,
	}
	for k, n := range want {
		if counts[k] != n {
			t.Errorf("%s observed %d times, want %d (have %v)", k, counts[k], n, counts)
		}
	}
	if len(counts) != len(want) {
		t.Errorf("histogram series = %v, want exactly %v", counts, want)
	}
	if n := testutil.CollectAndCount(e.m.rejected); n != 0 {
		t.Errorf("rejected series = %d before any rejection", n)
	}
}

func labels(m *dto.Metric) string {
	var parts []string
	for _, l := range m.GetLabel() {
		parts = append(parts, l.GetName()+"="+l.GetValue())
	}
	return strings.Join(parts, ",")
}
