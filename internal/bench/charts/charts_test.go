package charts

import (
	"bytes"
	"encoding/json"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/bench/report"
)

// result is a finished timed result of n samples lo, lo+step, ...
// (shuffled, as a run records them).
func result(name string, kind report.Kind, c, n int, lo, step time.Duration) *report.Result {
	s := make([]time.Duration, n)
	for i := range s {
		s[(i*7)%n] = lo + time.Duration(i)*step // 7 is prime to the n used here
	}
	r := report.Timed(name, kind, report.Params{N: n, Concurrency: c}, s, 0, time.Second)
	r.Finish()
	return r
}

// testReport has what every chart needs: create-c1 against two
// baselines, create-c50 against runc-run at c=50, pause against the
// freezer (microseconds against milliseconds), an old result with no
// samples, and a density fill.
func testReport() *report.Report {
	ms := time.Millisecond
	runc1 := result("runc-run", report.KindBaseline, 1, 100, 40*ms, ms/2)
	podman := result("podman-run", report.KindBaseline, 1, 100, 150*ms, ms)
	c1 := result("create-c1", report.KindCube, 1, 100, 45*ms, ms/2)
	c1.Compare = []report.Comparison{report.Compare(c1, runc1), report.Compare(c1, podman)}
	runc50 := result("runc-run", report.KindBaseline, 50, 1000, 200*ms, 2*ms)
	c50 := result("create-c50", report.KindCube, 50, 1000, 210*ms, 2*ms)
	c50.Compare = []report.Comparison{report.Compare(c50, runc50)}
	freeze := result("freezer-freeze", report.KindBaseline, 1, 100, 50*time.Microsecond, time.Microsecond)
	pause := result("pause", report.KindCube, 1, 100, 2*ms, ms/50)
	pause.Compare = []report.Comparison{report.Compare(pause, freeze)}
	old := result("destroy", report.KindCube, 1, 100, 20*ms, ms/10)
	old.Dist = nil // a report from before results kept samples
	dens := &report.Result{Scenario: "density", Kind: report.KindCube, Params: report.Params{N: 30, Concurrency: 8}, Density: &report.DensityReport{
		Sandboxes: 30,
		Growth: []report.DensityPoint{
			{Sandboxes: 10, Measured: 10, Total: 2 << 20, NodePerSandbox: 5 << 20, CubeletRSS: 30 << 20},
			{Sandboxes: 20, Measured: 20, Total: 2 << 20, NodePerSandbox: 4 << 20, CubeletRSS: 32 << 20},
			{Sandboxes: 30, Measured: 30, Total: 3 << 20, NodePerSandbox: 4 << 20, CubeletRSS: 33 << 20, Settled: true},
		},
	}}
	skipped := &report.Result{Scenario: "snapshot", Kind: report.KindCube, Skipped: "skipped: no snapshots"}
	return &report.Report{RunID: "r1", Results: []*report.Result{runc1, podman, c1, runc50, c50, freeze, pause, old, dens, skipped}}
}

// svgPath is a stroked path of a chart.
type svgPath struct {
	stroke string // "#0072B2"
	points int    // M and L commands
}

// parseSVG checks doc is well-formed XML with an <svg> root and returns
// its stroked paths and texts.
func parseSVG(t *testing.T, name string, doc []byte) ([]svgPath, []string) {
	t.Helper()
	dec := xml.NewDecoder(bytes.NewReader(doc))
	stroke := regexp.MustCompile(`stroke:(#[0-9A-Fa-f]{6})`)
	var paths []svgPath
	var texts []string
	root, inText := "", false
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("%s: not well-formed XML: %v", name, err)
		}
		switch el := tok.(type) {
		case xml.StartElement:
			if root == "" {
				root = el.Name.Local
			}
			inText = el.Name.Local == "text"
			if el.Name.Local != "path" {
				continue
			}
			var d, style string
			for _, a := range el.Attr {
				switch a.Name.Local {
				case "d":
					d = a.Value
				case "style":
					style = a.Value
				}
			}
			if m := stroke.FindStringSubmatch(style); m != nil && !strings.Contains(style, "fill:#") {
				paths = append(paths, svgPath{stroke: strings.ToUpper(m[1]), points: strings.Count(d, "M") + strings.Count(d, "L")})
			}
		case xml.CharData:
			if inText {
				texts = append(texts, string(el))
			}
		case xml.EndElement:
			inText = false
		}
	}
	if root != "svg" {
		t.Fatalf("%s: root element %q, want svg", name, root)
	}
	return paths, texts
}

func hex(i int) string {
	c := Palette[i]
	return fmt.Sprintf("#%02X%02X%02X", c.R, c.G, c.B)
}

// seriesStrokes counts the stroked paths per palette colour.
func seriesStrokes(paths []svgPath) map[string][]svgPath {
	out := map[string][]svgPath{}
	for _, p := range paths {
		for i := range Palette {
			if p.stroke == hex(i) {
				out[p.stroke] = append(out[p.stroke], p)
			}
		}
	}
	return out
}

func TestDraw(t *testing.T) {
	rep := testReport()
	charts, notes, err := Draw(rep, "results")
	if err != nil {
		t.Fatal(err)
	}
	byFile := map[string]Chart{}
	var files []string
	for _, c := range charts {
		byFile[c.File] = c
		files = append(files, c.File)
	}
	want := []string{"results-cdf-create-c1.svg", "results-cdf-create-c50.svg", "results-cdf-pause.svg", "results-cdf-destroy.svg",
		"results-concurrency.svg", "results-density-memory.svg", "results-density-cubelet.svg"}
	if !slices.Equal(files, want) {
		t.Fatalf("charts %q, want %q", files, want)
	}
	for _, c := range charts {
		parseSVG(t, c.File, c.SVG)
	}

	// One curve per series: the CDF of create-c1 against runc-run and
	// podman-run has three colours, each stroked twice (its curve and
	// its legend line), and each curve is the step function of its 100
	// samples (two points per sample).
	paths, texts := parseSVG(t, "cdf-create-c1", byFile["results-cdf-create-c1.svg"].SVG)
	per := seriesStrokes(paths)
	if len(per) != 3 {
		t.Fatalf("create-c1 CDF: %d series colours, want 3: %v", len(per), per)
	}
	for i := range 3 {
		ps := per[hex(i)]
		if len(ps) != 2 || max(ps[0].points, ps[1].points) != 200 {
			t.Errorf("series %d (%s): stroked paths %+v, want the 200-point curve and its legend line", i, hex(i), ps)
		}
	}
	for _, l := range []string{"create-c1 (n=100, c=1)", "runc-run (n=100, c=1)", "podman-run (n=100, c=1)"} {
		if !slices.Contains(texts, l) {
			t.Errorf("create-c1 CDF: no legend %q in %q", l, texts)
		}
	}
	// create-c50 pairs with runc-run at c=50 (1000 samples, kept as
	// report.MaxDist), not the c=1 one.
	paths, texts = parseSVG(t, "cdf-create-c50", byFile["results-cdf-create-c50.svg"].SVG)
	if per := seriesStrokes(paths); len(per) != 2 || slices.ContainsFunc(per[hex(1)], func(p svgPath) bool { return p.points != 2*report.MaxDist && p.points != 2 }) {
		t.Errorf("create-c50 CDF: %+v", per)
	}
	if !slices.Contains(texts, "runc-run (n=1000, c=50)") {
		t.Errorf("create-c50 CDF legend: %q", texts)
	}
	// Pause (ms) against the freezer (µs) gets a log axis with labels
	// below 1 ms.
	if _, texts := parseSVG(t, "cdf-pause", byFile["results-cdf-pause.svg"].SVG); !slices.Contains(texts, "0.05") || !slices.Contains(texts, "1") {
		t.Errorf("pause CDF: want log ticks 0.05 and 1 among %q", texts)
	}
	if c := byFile["results-cdf-pause.svg"].Caption; !strings.Contains(c, "Logarithmic") {
		t.Errorf("pause caption: %q", c)
	}
	// A result without samples is drawn from its percentiles, and says so.
	if c := byFile["results-cdf-destroy.svg"].Caption; !strings.Contains(c, "percentiles") {
		t.Errorf("destroy caption: %q", c)
	}
	// Concurrency: create and runc-run, each P50 and P99 (a line and a
	// legend line each).
	paths, texts = parseSVG(t, "concurrency", byFile["results-concurrency.svg"].SVG)
	per = seriesStrokes(paths)
	if len(per) != 2 || len(per[hex(0)]) != 4 || len(per[hex(1)]) != 4 {
		t.Errorf("concurrency: %+v", per)
	}
	for _, l := range []string{"create P50", "create P99", "runc-run P50", "runc-run P99", "50"} {
		if !slices.Contains(texts, l) {
			t.Errorf("concurrency: no %q in %q", l, texts)
		}
	}
	paths, _ = parseSVG(t, "density-memory", byFile["results-density-memory.svg"].SVG)
	if per := seriesStrokes(paths); len(per) != 2 || slices.ContainsFunc(per[hex(0)], func(p svgPath) bool { return p.points != 3 && p.points != 2 }) {
		t.Errorf("density memory: %+v", per)
	}
	if len(notes) != 1 || !strings.Contains(notes[0], "percentiles") {
		t.Errorf("notes: %q", notes)
	}
}

// TestDrawDeterministic: the same report gives the same bytes, and so
// does the report read back from its JSON (what `cube-bench charts
// --from` draws).
func TestDrawDeterministic(t *testing.T) {
	a, _, err := Draw(testReport(), "results")
	if err != nil {
		t.Fatal(err)
	}
	var js bytes.Buffer
	if err := report.WriteJSON(&js, testReport()); err != nil {
		t.Fatal(err)
	}
	var back report.Report
	if err := json.Unmarshal(js.Bytes(), &back); err != nil {
		t.Fatal(err)
	}
	for _, rep := range []*report.Report{testReport(), &back} {
		b, _, err := Draw(rep, "results")
		if err != nil {
			t.Fatal(err)
		}
		if len(a) != len(b) {
			t.Fatalf("%d charts, then %d", len(a), len(b))
		}
		for i := range a {
			if a[i].File != b[i].File || !bytes.Equal(a[i].SVG, b[i].SVG) {
				t.Errorf("%s: differs between two draws", a[i].File)
			}
		}
	}
}

func TestDrawNotes(t *testing.T) {
	ms := time.Millisecond
	c1 := result("create-c1", report.KindCube, 1, 10, 45*ms, ms)
	old := &report.Result{Scenario: "density", Kind: report.KindCube, Density: &report.DensityReport{Sandboxes: 1000}}
	charts, notes, err := Draw(&report.Report{Results: []*report.Result{c1, old}}, "r")
	if err != nil {
		t.Fatal(err)
	}
	if len(charts) != 1 || charts[0].File != "r-cdf-create-c1.svg" {
		t.Errorf("charts: %+v", charts)
	}
	if len(notes) != 2 || !strings.Contains(notes[0], "concurrency") || !strings.Contains(notes[1], "0 growth points") {
		t.Errorf("notes: %q", notes)
	}
}

// TestWrite: the files land in the directory, the Markdown embeds them,
// and a previous run's charts of the same prefix go, not another
// prefix's nor other files.
func TestWrite(t *testing.T) {
	dir := t.TempDir()
	for _, f := range []string{"results-cdf-gone.svg", "results-density-clones-memory.svg", "results-cluster-cdf-create-c1.svg", "notes.svg", "results.json"} {
		if err := os.WriteFile(filepath.Join(dir, f), []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	rep := testReport()
	if err := Write(dir, Prefix("bench/RESULTS.md"), rep); err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	for _, f := range []string{"results-cluster-cdf-create-c1.svg", "notes.svg", "results.json", "results-cdf-create-c1.svg", "results-density-cubelet.svg"} {
		if !slices.Contains(names, f) {
			t.Errorf("%s missing from %q", f, names)
		}
	}
	if slices.Contains(names, "results-cdf-gone.svg") || slices.Contains(names, "results-density-clones-memory.svg") {
		t.Errorf("stale chart kept: %q", names)
	}
	if len(rep.Charts) != 7 {
		t.Fatalf("rep.Charts: %+v", rep.Charts)
	}
	var md bytes.Buffer
	if err := report.WriteMarkdown(&md, rep); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"## Charts", "### Latency CDFs", "![create-c1: latency CDF against its baselines](results-cdf-create-c1.svg)",
		"### Memory against sandboxes", "](results-density-memory.svg)", "percentiles"} {
		if !strings.Contains(md.String(), s) {
			t.Errorf("markdown lacks %q", s)
		}
	}

	// A density-clones result draws charts of its own, beside density's.
	clones := *rep.Results[8]
	if clones.Scenario != "density" {
		t.Fatalf("test report changed: %+v", clones)
	}
	clones.Scenario = "density-clones"
	rep.Results = append(rep.Results, &clones)
	if err := Write(dir, Prefix("bench/RESULTS.md"), rep); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"results-density-memory.svg", "results-density-clones-memory.svg", "results-density-clones-cubelet.svg"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Errorf("density-clones: %v", err)
		}
	}
	md.Reset()
	if err := report.WriteMarkdown(&md, rep); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(md.String(), "![host memory per idle sandbox against sandboxes up (density-clones)](results-density-clones-memory.svg)") {
		t.Errorf("markdown lacks the density-clones chart:\n%s", md.String())
	}
}
