// Package charts draws cube-bench's report as SVG charts for the Markdown
// report: the latency CDF of each cube scenario against the raw baselines
// it is compared with, latency against concurrency for the scenarios the
// run measured at several concurrencies, and host memory against the
// number of idle sandboxes from the density fill. It reads only the report
// model (a run, or its JSON read back), so the charts of a finished run can
// be redrawn without running anything.
package charts

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"image/color"
	"maps"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/font"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgsvg"

	"github.com/cubesandbox/cube/internal/bench/report"
)

// Chart is one drawn chart: where the Markdown report links it, and the
// SVG document.
type Chart struct {
	report.Chart
	SVG []byte
}

// Size of every chart: wide enough for a legend of three series beside
// the curves, small enough to sit in a Markdown page.
const (
	width  = 18 * vg.Centimeter
	height = 11 * vg.Centimeter
)

// Palette is the colours of the series, in order: the Okabe-Ito
// colour-blind safe set without black (the axes are black).
var Palette = []color.RGBA{
	{0x00, 0x72, 0xB2, 0xff}, // blue: ours
	{0xD5, 0x5E, 0x00, 0xff}, // vermillion
	{0x00, 0x9E, 0x73, 0xff}, // green
	{0xCC, 0x79, 0xA7, 0xff}, // purple
	{0xE6, 0x9F, 0x00, 0xff}, // orange
	{0x56, 0xB4, 0xE9, 0xff}, // sky blue
}

func init() {
	// Sans-serif reads better at chart sizes than gonum/plot's default
	// serif; nothing else in cube-bench draws with gonum/plot.
	plot.DefaultFont = font.Font{Typeface: "Liberation", Variant: "Sans"}
}

func colour(i int) color.RGBA { return Palette[i%len(Palette)] }

// dashes of the i-th series: ours solid, the others dashed differently,
// so the curves part even in grey.
func dashes(i int) []vg.Length {
	switch i % 4 {
	case 0:
		return nil
	case 1:
		return []vg.Length{vg.Points(6), vg.Points(3)}
	case 2:
		return []vg.Length{vg.Points(2), vg.Points(2)}
	default:
		return []vg.Length{vg.Points(8), vg.Points(2), vg.Points(2), vg.Points(2)}
	}
}

// Draw draws every chart rep has the data for, named
// <prefix>-<chart>.svg; notes say which could not be drawn and why. The
// output depends on rep alone (same report, same bytes).
func Draw(rep *report.Report, prefix string) ([]Chart, []string, error) {
	var out []Chart
	var notes []string
	used := map[string]int{}
	name := func(s string) string {
		used[s]++
		if n := used[s]; n > 1 {
			s = fmt.Sprintf("%s-%d", s, n)
		}
		return prefix + "-" + s + ".svg"
	}
	add := func(section, title, file, caption string, p *plot.Plot) error {
		svg, err := render(p)
		if err != nil {
			return fmt.Errorf("chart %s: %w", file, err)
		}
		out = append(out, Chart{Chart: report.Chart{Section: section, Title: title, File: file, Caption: caption}, SVG: svg})
		return nil
	}

	summaryOnly := false
	for i, r := range rep.Results {
		if !timed(r) || r.Kind != report.KindCube {
			continue
		}
		p, caption, fromSummary, err := cdf(rep, i)
		if err != nil {
			return nil, nil, err
		}
		summaryOnly = summaryOnly || fromSummary
		if err := add("Latency CDFs", r.Scenario+": latency CDF against its baselines", name("cdf-"+r.Scenario), caption, p); err != nil {
			return nil, nil, err
		}
	}
	if summaryOnly {
		notes = append(notes, "The report keeps no latency samples for some scenarios (a run from before results.json kept them): their CDFs join the summary's percentiles (min, P50, P90, P95, P99, max), marked with dots.")
	}

	if p, caption, ok := concurrency(rep); ok {
		if err := add("Latency against concurrency", "latency against concurrency", name("concurrency"), caption, p); err != nil {
			return nil, nil, err
		}
	} else {
		notes = append(notes, "No latency-against-concurrency chart: no scenario was measured at more than one concurrency.")
	}

	for _, r := range rep.Results {
		if r.Density == nil {
			continue
		}
		g := r.Density.Growth
		if len(g) < 2 {
			notes = append(notes, fmt.Sprintf("No memory-against-sandboxes chart for %s: the run recorded %d growth points (need 2; runs from before density recorded them have none).", r.Scenario, len(g)))
			continue
		}
		mem, cub, err := density(r.Scenario, g)
		if err != nil {
			return nil, nil, err
		}
		of := ""
		if r.Scenario != "density" {
			of = " (" + r.Scenario + ")"
		}
		if err := add("Memory against sandboxes", "host memory per idle sandbox against sandboxes up"+of, name(r.Scenario+"-memory"),
			"Per sandbox: the average of cgroup charged + disk image page cache (over a spread of at most 20 sandboxes at each tenth of the fill, unsettled; over all of them after the settle, the last point), and the drop of the host's MemAvailable since the fill began divided by the sandboxes up.", mem); err != nil {
			return nil, nil, err
		}
		if err := add("Memory against sandboxes", "cubelet RSS against sandboxes up"+of, name(r.Scenario+"-cubelet"), "", cub); err != nil {
			return nil, nil, err
		}
	}
	return out, notes, nil
}

// Write draws the charts of rep into dir as <prefix>-<chart>.svg, removes
// chart files of that prefix a previous run left and this one did not
// draw, and records the charts (file names relative to dir) and notes in
// rep for the Markdown report.
func Write(dir, prefix string, rep *report.Report) error {
	charts, notes, err := Draw(rep, prefix)
	if err != nil {
		return err
	}
	keep := map[string]bool{}
	var refs []report.Chart
	for _, c := range charts {
		if err := os.WriteFile(filepath.Join(dir, c.File), c.SVG, 0o644); err != nil {
			return fmt.Errorf("write chart: %w", err)
		}
		keep[c.File] = true
		refs = append(refs, c.Chart)
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("list charts: %w", err)
	}
	// Only names Draw makes for this prefix: "results" must not take
	// "results-cluster-cdf-x.svg" for its own.
	own := regexp.MustCompile(`^` + regexp.QuoteMeta(prefix) + `-(cdf-.+|concurrency(-\d+)?|density(-clones)?-(memory|cubelet)(-\d+)?)\.svg$`)
	var errs []error
	for _, e := range ents {
		if n := e.Name(); own.MatchString(n) && !keep[n] {
			if err := os.Remove(filepath.Join(dir, n)); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("remove stale charts: %w", err)
	}
	rep.Charts, rep.ChartNotes = refs, notes
	return nil
}

// Prefix is the chart file prefix for a Markdown or JSON report path:
// its base name lower-cased, without extension (bench/RESULTS.md and
// bench/results.json both give "results").
func Prefix(path string) string {
	b := filepath.Base(path)
	return strings.ToLower(strings.TrimSuffix(b, filepath.Ext(b)))
}

func render(p *plot.Plot) ([]byte, error) {
	c := vgsvg.New(width, height)
	// gonum/plot draws to the canvas' edge; the margin keeps the last
	// tick label and the legend's lines from being cut off.
	p.Draw(draw.Crop(draw.New(c), vg.Points(4), -vg.Points(14), vg.Points(2), -vg.Points(4)))
	var b bytes.Buffer
	if _, err := c.WriteTo(&b); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// timed: r measured latencies.
func timed(r *report.Result) bool {
	return r.Skipped == "" && r.Error == "" && r.Latency != nil && r.Latency.N > 0
}

func ms(d time.Duration) float64 { return float64(d) / 1e6 }

// series is one curve.
type series struct {
	label       string
	pts         plotter.XYs
	fromSummary bool // joined percentiles, not samples
}

// cdfSeries is r's empirical CDF: a step of 1/N at every sample (of the
// kept order statistics, a step to the rank each stands for), or, with
// no samples kept, its summary's percentiles joined by straight lines.
func cdfSeries(r *report.Result, label string) series {
	s := series{label: label}
	if len(r.Dist) == 0 {
		l := r.Latency
		s.fromSummary = true
		s.pts = plotter.XYs{{X: ms(l.Min), Y: 0}, {X: ms(l.P50), Y: .5}, {X: ms(l.P90), Y: .9}, {X: ms(l.P95), Y: .95}, {X: ms(l.P99), Y: .99}, {X: ms(l.Max), Y: 1}}
		return s
	}
	n := max(r.Latency.N, len(r.Dist))
	prev := 0.0
	for i, d := range r.Dist {
		y := float64(report.ThinRank(i, n, len(r.Dist))+1) / float64(n)
		s.pts = append(s.pts, plotter.XY{X: ms(d), Y: prev}, plotter.XY{X: ms(d), Y: y})
		prev = y
	}
	return s
}

// baselineOf finds the result of baseline name that the i-th result was
// compared with: of that name, at the same concurrency and listed before
// it (the runner lists a scenario's fresh baselines just before it), the
// nearest; else at the same concurrency; else any.
func baselineOf(rep *report.Report, i int, name string) *report.Result {
	conc := rep.Results[i].Params.Concurrency
	var best *report.Result
	bestScore := 0
	for j, b := range rep.Results {
		if b.Scenario != name || !timed(b) || j == i {
			continue
		}
		score := 1
		if b.Params.Concurrency == conc {
			score = 2
			if j < i {
				score = 3 // later ones overwrite: the nearest before i wins
			}
		}
		if score >= bestScore && (score == 3 || best == nil || score > bestScore) {
			best, bestScore = b, score
		}
	}
	return best
}

func label(r *report.Result) string {
	return fmt.Sprintf("%s (n=%d, c=%d)", r.Scenario, r.Latency.N, r.Params.Concurrency)
}

// cdf is the i-th result's latency CDF with one curve per baseline it was
// compared with.
func cdf(rep *report.Report, i int) (*plot.Plot, string, bool, error) {
	r := rep.Results[i]
	all := []series{cdfSeries(r, label(r))}
	var baseNames []string
	for _, c := range r.Compare {
		if c.Skipped != "" {
			continue
		}
		if b := baselineOf(rep, i, c.Baseline); b != nil {
			all = append(all, cdfSeries(b, label(b)))
			baseNames = append(baseNames, c.Baseline)
		}
	}
	p := plot.New()
	p.Title.Text = r.Scenario + ": latency CDF"
	p.X.Label.Text = "latency (ms)"
	p.Y.Label.Text = "fraction of operations at most x"
	// Headroom above 1 holds the legend, clear of the curves.
	p.Y.Min, p.Y.Max = 0, 1.08+0.07*float64(len(all))
	p.Y.Tick.Marker = plot.ConstantTicks{{Value: 0, Label: "0"}, {Value: .25, Label: "0.25"}, {Value: .5, Label: "0.5"},
		{Value: .75, Label: "0.75"}, {Value: .9, Label: "0.9"}, {Value: .99}, {Value: 1, Label: "1"}}
	p.Legend.Top, p.Legend.Left = true, true
	p.Legend.TextStyle.Font.Size = vg.Points(10)
	p.Add(plotter.NewGrid())
	lo, hi := math.Inf(1), 0.0
	fromSummary := false
	for _, s := range all {
		for _, pt := range s.pts {
			lo, hi = min(lo, pt.X), max(hi, pt.X)
		}
		fromSummary = fromSummary || s.fromSummary
	}
	// A freezer write is tens of microseconds, our pause milliseconds:
	// a linear axis would squash the baseline against zero.
	logX := lo > 0 && hi/lo > 20
	if logX {
		p.X.Scale = plot.LogScale{}
		p.X.Tick.Marker = logTicks{}
	}
	for k, s := range all {
		if err := addLine(p, k, s); err != nil {
			return nil, "", false, err
		}
	}
	caption := fmt.Sprintf("%#q (solid)", r.Scenario)
	if len(baseNames) > 0 {
		caption += " against " + strings.Join(quote(baseNames), ", ")
	} else {
		caption += "; no baseline measured with it"
	}
	caption += ": the fraction of operations that took at most x."
	if logX {
		caption += " Logarithmic latency axis."
	}
	if fromSummary {
		caption += " Dots: the run kept no samples, so the curve joins its summary's percentiles (min, P50, P90, P95, P99, max)."
	}
	return p, caption, fromSummary, nil
}

// logTicks marks a logarithmic axis at 1, 2 and 5 times each power of
// ten, labelled, and the other integer multiples unlabelled. (plot.LogTicks
// starts below a range under 1 at 1, leaving microsecond figures bare.)
type logTicks struct{}

func (logTicks) Ticks(lo, hi float64) []plot.Tick {
	var out []plot.Tick
	for e := math.Floor(math.Log10(lo)); math.Pow(10, e) <= hi; e++ {
		for m := 1; m < 10; m++ {
			v := float64(m) * math.Pow(10, e)
			t := plot.Tick{Value: v}
			if m == 1 || m == 2 || m == 5 {
				t.Label = strconvFloat(v)
			}
			out = append(out, t)
		}
	}
	return out
}

// strconvFloat renders v with the fewest digits that give it back.
func strconvFloat(v float64) string { return strconv.FormatFloat(v, 'g', -1, 64) }

func quote(ss []string) []string {
	out := make([]string, len(ss))
	for i, s := range ss {
		out[i] = "`" + s + "`"
	}
	return out
}

// addLine adds s as the k-th series: its line, dots where it joins
// percentiles, and its legend entry.
func addLine(p *plot.Plot, k int, s series) error {
	l, err := plotter.NewLine(s.pts)
	if err != nil {
		return fmt.Errorf("series %s: %w", s.label, err)
	}
	l.Color = colour(k)
	l.Width = vg.Points(1.5)
	l.Dashes = dashes(k)
	p.Add(l)
	if !s.fromSummary {
		p.Legend.Add(s.label, l)
		return nil
	}
	sc, err := plotter.NewScatter(s.pts)
	if err != nil {
		return fmt.Errorf("series %s: %w", s.label, err)
	}
	sc.GlyphStyle = draw.GlyphStyle{Color: colour(k), Radius: vg.Points(2.5), Shape: draw.CircleGlyph{}}
	p.Add(sc)
	p.Legend.Add(s.label, l, sc)
	return nil
}

// concSuffix ends the names of one operation's variants at other
// concurrencies: create-c1 and create-c50, e2b-tti and e2b-tti-burst.
var concSuffix = regexp.MustCompile(`-(c\d+|burst)$`)

// concurrency draws P50 and P99 against concurrency for every operation
// (scenario name without its -c<N> or -burst suffix) measured at two
// concurrencies or more; the measurement with most samples stands for a
// concurrency measured twice (runc-run for create-c1 and for clone-1).
func concurrency(rep *report.Report) (*plot.Plot, string, bool) {
	fam := map[string]map[int]*report.Result{}
	for _, r := range rep.Results {
		if !timed(r) {
			continue
		}
		f := concSuffix.ReplaceAllString(r.Scenario, "")
		if fam[f] == nil {
			fam[f] = map[int]*report.Result{}
		}
		c := r.Params.Concurrency
		if o := fam[f][c]; o == nil || r.Latency.N > o.Latency.N {
			fam[f][c] = r
		}
	}
	var names []string
	concs := map[int]bool{}
	for f, byC := range fam {
		if len(byC) >= 2 {
			names = append(names, f)
			for c := range byC {
				concs[c] = true
			}
		}
	}
	if len(names) == 0 {
		return nil, "", false
	}
	// Ours (cube scenarios) first, then the baselines, each by name.
	kindOf := func(f string) report.Kind {
		for _, r := range fam[f] {
			return r.Kind
		}
		return ""
	}
	slices.SortFunc(names, func(a, b string) int {
		if ka, kb := kindOf(a), kindOf(b); ka != kb {
			return cmp.Compare(kb, ka) // "cube" before "baseline"
		}
		return cmp.Compare(a, b)
	})
	p := plot.New()
	p.Title.Text = "latency against concurrency"
	p.X.Label.Text = "operations in flight"
	p.Y.Label.Text = "latency (ms)"
	p.X.Scale, p.Y.Scale = plot.LogScale{}, plot.LogScale{}
	var ticks plot.ConstantTicks
	for _, c := range slices.Sorted(maps.Keys(concs)) {
		ticks = append(ticks, plot.Tick{Value: float64(c), Label: fmt.Sprint(c)})
	}
	p.X.Tick.Marker = ticks
	p.Y.Tick.Marker = logTicks{}
	p.Legend.Top, p.Legend.Left = true, true
	p.Legend.TextStyle.Font.Size = vg.Points(10)
	p.Add(plotter.NewGrid())
	var parts []string
	for k, f := range names {
		var p50, p99 plotter.XYs
		var ms50 []string
		for _, c := range slices.Sorted(maps.Keys(fam[f])) {
			r := fam[f][c]
			p50 = append(p50, plotter.XY{X: float64(c), Y: ms(r.Latency.P50)})
			p99 = append(p99, plotter.XY{X: float64(c), Y: ms(r.Latency.P99)})
			ms50 = append(ms50, r.Scenario)
		}
		for j, pts := range []plotter.XYs{p50, p99} {
			l, sc, err := plotter.NewLinePoints(pts)
			if err != nil {
				continue // only NaN or Inf: latencies are finite
			}
			l.Color, l.Width = colour(k), vg.Points(1.5)
			sc.GlyphStyle = draw.GlyphStyle{Color: colour(k), Radius: vg.Points(2.5), Shape: draw.CircleGlyph{}}
			what := "P50"
			if j == 1 {
				l.Dashes = dashes(1)
				sc.GlyphStyle.Shape = draw.BoxGlyph{}
				what = "P99"
			}
			p.Add(l, sc)
			p.Legend.Add(f+" "+what, l, sc)
		}
		parts = append(parts, strings.Join(quote(slices.Compact(ms50)), ", "))
	}
	caption := "P50 (solid, dots) and P99 (dashed, squares) of each operation measured at several concurrencies: " +
		strings.Join(parts, "; ") + ". Both axes logarithmic."
	return p, caption, true
}

func mib(b report.Bytes) float64 { return float64(b) / (1 << 20) }

// density draws memory per sandbox and cubelet's RSS against the number
// of sandboxes up.
func density(name string, g []report.DensityPoint) (*plot.Plot, *plot.Plot, error) {
	var total, node, cub plotter.XYs
	for _, pt := range g {
		x := float64(pt.Sandboxes)
		total = append(total, plotter.XY{X: x, Y: mib(pt.Total)})
		node = append(node, plotter.XY{X: x, Y: mib(pt.NodePerSandbox)})
		cub = append(cub, plotter.XY{X: x, Y: mib(pt.CubeletRSS)})
	}
	mk := func(title, ylabel string) *plot.Plot {
		p := plot.New()
		p.Title.Text = title
		p.X.Label.Text = "idle sandboxes up (" + name + ")"
		p.Y.Label.Text = ylabel
		p.Y.Min = 0
		p.Legend.Top, p.Legend.Left = true, false
		p.Legend.TextStyle.Font.Size = vg.Points(10)
		p.Add(plotter.NewGrid())
		return p
	}
	mem := mk("host memory per idle sandbox", "MiB per sandbox")
	for k, s := range []struct {
		label string
		pts   plotter.XYs
	}{{"charged + disk image cache, avg", total}, {"host MemAvailable drop / sandboxes", node}} {
		if err := addLinePoints(mem, k, s.label, s.pts); err != nil {
			return nil, nil, err
		}
	}
	c := mk("cubelet RSS", "MiB")
	if err := addLinePoints(c, 0, "cubelet RSS", cub); err != nil {
		return nil, nil, err
	}
	// Headroom above the highest point holds the legend.
	for _, p := range []*plot.Plot{mem, c} {
		if p.Y.Max > 0 {
			p.Y.Max *= 1.3
		}
	}
	return mem, c, nil
}

func addLinePoints(p *plot.Plot, k int, label string, pts plotter.XYs) error {
	l, sc, err := plotter.NewLinePoints(pts)
	if err != nil {
		return fmt.Errorf("series %s: %w", label, err)
	}
	l.Color, l.Width, l.Dashes = colour(k), vg.Points(1.5), dashes(k)
	sc.GlyphStyle = draw.GlyphStyle{Color: colour(k), Radius: vg.Points(2.5), Shape: draw.CircleGlyph{}}
	p.Add(l, sc)
	p.Legend.Add(label, l, sc)
	return nil
}
