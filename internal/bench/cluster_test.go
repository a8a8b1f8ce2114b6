package bench

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/bench/report"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/leakcheck"
)

// TestClusterScenariosTiny runs the cluster scenarios with tiny N: one
// cluster built for all four, each create compared with the single-node
// figure of the same run, every sandbox spread over the node hosts, and
// the run's cleanup tearing the cluster down with nothing left (the
// harness's leak checks fail the cleanup).
func TestClusterScenariosTiny(t *testing.T) {
	cubelettest.RequireRoot(t)
	bin := cubelettest.Binaries(t)
	o := report.DefaultOptions()
	o.N1, o.N50, o.Concurrency, o.MaxLive, o.Chunks = 3, 6, 3, 4, 2 // cluster-create-c50: two rounds
	runID := NewRunID()
	work := filepath.Join(os.TempDir(), "cube-bench-test-"+runID)
	ctx := context.Background()
	e, cleanup, err := Prepare(ctx, Setup{RunID: runID, BinDir: bin, WorkDir: work, Opts: o, Progress: NewProgress(testWriter{t})})
	if err != nil {
		t.Fatal(err)
	}
	cleaned := false
	t.Cleanup(func() {
		if !cleaned {
			_ = cleanup(ctx)
		}
	})
	list, err := Resolve([]string{"cluster-create-c1", "cluster-create-c50", "cluster-template", "cluster-template-32m"})
	if err != nil {
		t.Fatal(err)
	}
	rep := Run(ctx, e, list)
	var tab strings.Builder
	if err := report.WriteTable(&tab, rep); err != nil {
		t.Fatal(err)
	}
	t.Log("\n" + tab.String())
	leakcheck.AssertNone(t, ctx, e.Node().Scope())

	byName := map[string]*report.Result{}
	for _, r := range rep.Results {
		byName[r.Scenario] = r
	}
	want := map[string]int{"cluster-create-c1": 3, "cluster-create-c50": 6, "cluster-template": 3, "cluster-template-32m": 3,
		"create-c1": 3, "create-c50": 6}
	for name, n := range want {
		r := byName[name]
		switch {
		case r == nil:
			t.Errorf("%s: no result", name)
		case r.Error != "" || r.Skipped != "" || r.Failed != 0:
			t.Errorf("%s: error %q, skipped %q, failed %d, notes %q", name, r.Error, r.Skipped, r.Failed, r.Notes)
		case r.Latency == nil || r.Latency.N != n || r.Latency.Min <= 0:
			t.Errorf("%s: latency %+v, want %d samples", name, r.Latency, n)
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	for name, base := range map[string]string{"cluster-create-c1": "create-c1", "cluster-create-c50": "create-c50"} {
		r := byName[name]
		if len(r.Compare) != 1 || r.Compare[0].Baseline != base || r.Compare[0].RatioAvg <= 0 {
			t.Errorf("%s compared with %+v, want %s", name, r.Compare, base)
		}
		notes := strings.Join(r.Notes, "\n")
		if !strings.Contains(notes, "first envd /health through a proxy host") || !strings.Contains(notes, "sandboxes per node host: n1 ") {
			t.Errorf("%s notes: %s", name, notes)
		}
	}
	// The creates spread over the node hosts: every one counted on a
	// host, more than one host used.
	for name, n := range map[string]int{"cluster-create-c1": 3, "cluster-create-c50": 6} {
		m := regexp.MustCompile(`sandboxes per node host: n1 (\d+), n2 (\d+), n3 (\d+)`).FindStringSubmatch(strings.Join(byName[name].Notes, "\n"))
		if m == nil {
			t.Errorf("%s: no spread note in %q", name, byName[name].Notes)
			continue
		}
		sum, used := 0, 0
		for _, v := range m[1:] {
			k, _ := strconv.Atoi(v)
			sum += k
			if k > 0 {
				used++
			}
		}
		if sum != n || used < 2 {
			t.Errorf("%s: %s: want %d sandboxes over at least 2 hosts", name, m[0], n)
		}
	}
	if r := byName["cluster-template-32m"]; !strings.Contains(strings.Join(r.Notes, "\n"), "32 MiB layer") {
		t.Errorf("cluster-template-32m notes: %q", r.Notes)
	}

	if e.clus.c == nil {
		t.Fatal("no cluster was built")
	}
	// This run's namespaces only: another cluster (a test of another
	// package running in parallel) has its own ID.
	prefix := "cube-cl-" + e.clus.c.ID + "-"
	cleaned = true
	if err := cleanup(ctx); err != nil {
		t.Fatalf("cleanup (cluster teardown and its leak checks): %v", err)
	}
	out, _ := exec.Command("ip", "netns", "list").Output()
	if strings.Contains(string(out), prefix) {
		t.Errorf("cluster namespaces left: %s", out)
	}
}
