package bench

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/bench/report"
)

func TestSpread(t *testing.T) {
	for _, c := range []struct {
		n, k int
		want string
	}{
		{100, 10, "[10 10 10 10 10 10 10 10 10 10]"},
		{5, 10, "[0 1 0 1 0 1 0 1 0 1]"},
		{3, 10, "[0 0 0 1 0 0 1 0 0 1]"},
		{7, 3, "[2 2 3]"},
		{0, 4, "[0 0 0 0]"},
		{5, 0, "[5]"},
	} {
		got := spread(c.n, c.k)
		if fmt.Sprint(got) != c.want {
			t.Errorf("spread(%d, %d) = %v, want %s", c.n, c.k, got, c.want)
		}
		sum := 0
		for _, v := range got {
			sum += v
		}
		if sum != c.n {
			t.Errorf("spread(%d, %d) sums to %d", c.n, c.k, sum)
		}
	}
}

// TestBaselineCap: a baseline capped by --baseline-n below the number of
// chunks runs its N samples spread over the chunks (it used to index
// past its parts and panic), and the scenario still runs all of its own.
func TestBaselineCap(t *testing.T) {
	var baseN, cubeN atomic.Int64
	sample := func(n *atomic.Int64) func(context.Context, *Env, report.Params) (*report.Result, error) {
		return func(_ context.Context, _ *Env, p report.Params) (*report.Result, error) {
			n.Add(int64(p.N))
			r := &report.Result{}
			for range p.N {
				r.Samples = append(r.Samples, time.Millisecond)
			}
			return r, nil
		}
	}
	base := &Scenario{Name: "test-cap-base", Kind: report.KindBaseline, Params: func(report.Options) report.Params { return report.Params{N: 100} }, Run: sample(&baseN)}
	cube := &Scenario{Name: "test-cap-cube", Kind: report.KindCube, Baselines: []string{base.Name},
		Params: func(report.Options) report.Params { return report.Params{N: 100} }, Run: sample(&cubeN)}
	regMu.Lock()
	registry[base.Name] = base
	regMu.Unlock()
	t.Cleanup(func() {
		regMu.Lock()
		delete(registry, base.Name)
		regMu.Unlock()
	})
	e := &Env{Opts: report.Options{BaselineN: 5, Chunks: 10}}
	rep := &report.Report{}
	runCube(context.Background(), e, cube, report.Params{N: 100}, "runc", map[string]*report.Result{}, rep)
	if baseN.Load() != 5 || cubeN.Load() != 100 {
		t.Fatalf("baseline ran %d samples (want 5), the scenario %d (want 100)", baseN.Load(), cubeN.Load())
	}
	if len(rep.Results) != 2 || len(rep.Results[1].Compare) != 1 {
		t.Fatalf("results %+v", rep.Results)
	}
}

// A Whole scenario runs its N in one call, after all of its baseline's
// samples; the same scenario without Whole alternates chunks with it.
func TestWholeScenarioOneChunk(t *testing.T) {
	for _, whole := range []bool{true, false} {
		var order []string
		sample := func(name string) func(context.Context, *Env, report.Params) (*report.Result, error) {
			return func(_ context.Context, _ *Env, p report.Params) (*report.Result, error) {
				order = append(order, fmt.Sprintf("%s:%d", name, p.N))
				r := &report.Result{}
				for range p.N {
					r.Samples = append(r.Samples, time.Millisecond)
				}
				return r, nil
			}
		}
		base := &Scenario{Name: "test-whole-base", Kind: report.KindBaseline, Params: func(report.Options) report.Params { return report.Params{N: 40} }, Run: sample("base")}
		cube := &Scenario{Name: "test-whole-cube", Kind: report.KindCube, Baselines: []string{base.Name}, Whole: whole,
			Params: func(report.Options) report.Params { return report.Params{N: 40} }, Run: sample("cube")}
		regMu.Lock()
		registry[base.Name] = base
		regMu.Unlock()
		e := &Env{Opts: report.Options{Chunks: 4}}
		rep := &report.Report{}
		runCube(context.Background(), e, cube, report.Params{N: 40}, "runc", map[string]*report.Result{}, rep)
		regMu.Lock()
		delete(registry, base.Name)
		regMu.Unlock()
		want := "base:10,cube:10,base:10,cube:10,base:10,cube:10,base:10,cube:10"
		if whole {
			want = "base:40,cube:40"
		}
		if got := strings.Join(order, ","); got != want {
			t.Errorf("whole=%t: ran %s, want %s", whole, got, want)
		}
		if len(rep.Results) != 2 || len(rep.Results[1].Samples) != 40 || len(rep.Results[1].Compare) != 1 {
			t.Errorf("whole=%t: results %+v", whole, rep.Results)
		}
	}
}
