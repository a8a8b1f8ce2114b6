// Command cube-bench measures cubelet (create-to-ready, pause, resume,
// destroy, density, and snapshot/clone/E2B where the node has them) side
// by side with the raw building blocks (bare runc, podman, the cgroup
// freezer) in the same run. It only wires flags to package bench and
// writes the report package bench/report renders, with the charts package
// bench/charts draws next to the Markdown report. `cube-bench charts
// --from FILE` redraws the charts (and the Markdown, with the targets
// evaluated as they are defined now) of a JSON report
// without running anything.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/cubesandbox/cube/internal/bench"
	"github.com/cubesandbox/cube/internal/bench/charts"
	"github.com/cubesandbox/cube/internal/bench/report"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "charts" {
		if err := chartsCmd(os.Args[2:]); err != nil {
			fatal(err)
		}
		return
	}
	o := report.DefaultOptions()
	var s bench.Setup
	flag.StringVar(&s.Addr, "addr", "", "drive this running cubelet (socket path or host:port) instead of starting a private one")
	flag.StringVar(&s.MetricsAddr, "metrics-addr", "", "with --addr: cubelet's metrics listener host:port (profiles, RSS)")
	flag.IntVar(&s.CubeletPID, "cubelet-pid", 0, "with --addr: cubelet's PID (RSS from /proc instead of /metrics)")
	flag.StringVar(&s.TLS.Cert, "tls-cert", "", "with --addr host:port or --metrics-addr of a cubelet with [tls]: a certificate of its cluster CA (cube up: <state>/pki/admin.crt)")
	flag.StringVar(&s.TLS.Key, "tls-key", "", "its key (cube up: <state>/pki/admin.key)")
	flag.StringVar(&s.TLS.CA, "tls-ca", "", "the cluster CA (cube up: <state>/pki/ca.crt)")
	flag.StringVar(&s.BinDir, "bin-dir", "", "directory with cubelet and cube-agent (default: next to cube-bench)")
	flag.StringVar(&s.WorkDir, "work-dir", "", "scratch directory, removed at the end (default: $TMPDIR/cube-bench-<run>)")
	scen := flag.String("scenarios", "all", "comma-separated scenarios; 'all' = every cube scenario (see --list)")
	list := flag.Bool("list", false, "list the scenarios and exit")
	flag.StringVar(&o.Template, "template", o.Template, "template to create sandboxes from")
	flag.StringVar(&o.Runtime, "runtime", "runc", "cubelet runtime to create sandboxes with: runc, gvisor or vm (smaller default N for the last two)")
	flag.StringVar(&s.VMGuestDir, "vm-guest-dir", "", "with --runtime vm: guest kernel and initramfs (default /var/lib/cube/vm, else built)")
	flag.IntVar(&o.N1, "n", o.N1, "samples of create-c1, pause, resume and destroy")
	flag.IntVar(&o.N50, "n-c50", o.N50, "samples of create-c50")
	flag.IntVar(&o.Concurrency, "concurrency", o.Concurrency, "creates in flight in create-c50")
	flag.IntVar(&o.MaxLive, "max-live", o.MaxLive, "most sandboxes a create scenario keeps up before destroying them (untimed)")
	flag.IntVar(&o.BaselineN, "baseline-n", 0, "cap on baseline samples (0 = as many as the scenario)")
	flag.IntVar(&o.Chunks, "chunks", o.Chunks, "run each scenario and its baselines in this many alternating chunks (1 = one after the other)")
	flag.BoolVar(&o.NoBaselines, "no-baselines", false, "skip the raw baselines")
	flag.IntVar(&o.DensityN, "density-n", o.DensityN, "idle sandboxes in the density scenario")
	flag.IntVar(&o.DensityConcurrency, "density-concurrency", o.DensityConcurrency, "creates in flight while filling the node")
	flag.BoolVar(&o.DensityNet, "density-net", o.DensityNet, "private node: run network-agent as its own process for runc too (every sandbox gets a slot); density reports its RSS")
	flag.IntVar(&o.DensityUse, "density-use", o.DensityUse, "commands each density sandbox runs through the proxy before the settle (0: idle as created); settle past the agent's 30 s quiet period to see what a used sandbox keeps (a use phase longer than that releases the first sandboxes' memory early)")
	flag.DurationVar(&o.DensitySettle, "density-settle", o.DensitySettle, "wait after the last density sandbox is up, before measuring")
	flag.IntVar(&o.SnapshotN, "snapshot-n", o.SnapshotN, "samples of snapshot and clone-1")
	flag.IntVar(&o.CloneCount, "clone-count", o.CloneCount, "sandboxes per CloneSandbox call in clone-n")
	flag.StringVar(&o.ProfileDir, "profile", "", "write cubelet CPU and heap profiles per scenario under this directory")
	flag.DurationVar(&o.ProfileWindow, "profile-window", o.ProfileWindow, "length of one CPU profile window")
	output := flag.String("o", "table", "stdout format: table or json")
	jsonOut := flag.String("json-out", "", "also write the JSON report to this file")
	mdOut := flag.String("markdown", "", "also write the report as Markdown (bench/RESULTS.md) to this file")
	noCharts := flag.Bool("no-charts", false, "with --markdown: draw no SVG charts next to it")
	quiet := flag.Bool("quiet", false, "no progress bar")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: cube-bench [flags]\n       cube-bench charts --from results.json [--markdown RESULTS.md] [--dir DIR]\n")
		flag.PrintDefaults()
	}
	flag.Parse()

	if *list {
		for _, sc := range bench.Scenarios("") {
			fmt.Printf("%-15s %-9s %s\n", sc.Name, sc.Kind, sc.Help)
		}
		return
	}
	if err := bench.CheckRuntime(o.Runtime); err != nil {
		fatal(err)
	}
	set := map[string]bool{}
	flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
	o.SmallDefaults(set)
	if *output != "table" && *output != "json" {
		fatal(fmt.Errorf("-o %q: want table or json", *output))
	}
	scenarios, err := bench.Resolve(strings.Split(*scen, ","))
	if err != nil {
		fatal(err)
	}
	if s.BinDir == "" {
		exe, err := os.Executable()
		if err != nil {
			fatal(err)
		}
		s.BinDir = filepath.Dir(exe)
	}
	s.Opts = o
	if !*quiet {
		s.Progress = bench.NewProgress(os.Stderr)
	}
	// Packages the bench reuses (storage, template) log through the
	// default logger; their info lines would break the progress bar.
	s.Log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	slog.SetDefault(s.Log)
	if err := run(s, scenarios, *output, *jsonOut, *mdOut, !*noCharts); err != nil {
		fatal(err)
	}
}

func run(s bench.Setup, scenarios []*bench.Scenario, output, jsonOut, mdOut string, draw bool) (err error) {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	env, cleanup, err := bench.Prepare(ctx, s)
	if err != nil {
		return err
	}
	rep := bench.Run(ctx, env, scenarios)
	rep.Command = strings.Join(os.Args, " ")
	if cerr := cleanup(ctx); cerr != nil {
		rep.Notes = append(rep.Notes, "cleanup: "+cerr.Error())
		err = fmt.Errorf("cleanup: %w", cerr)
	}
	if output == "json" {
		if err := report.WriteJSON(os.Stdout, rep); err != nil {
			return err
		}
	} else if err := report.WriteTable(os.Stdout, rep); err != nil {
		return err
	}
	if err := write(jsonOut, rep, report.WriteJSON); err != nil {
		return err
	}
	if mdOut != "" && draw {
		// The charts sit next to the Markdown that links them.
		if err := charts.Write(filepath.Dir(mdOut), charts.Prefix(mdOut), rep); err != nil {
			return err
		}
	}
	if err := write(mdOut, rep, report.WriteMarkdown); err != nil {
		return err
	}
	if ctx.Err() != nil {
		return fmt.Errorf("interrupted")
	}
	return err
}

// write renders rep into the file at path with f; nothing when path is "".
func write(path string, rep *report.Report, f func(io.Writer, *report.Report) error) error {
	if path == "" {
		return nil
	}
	out, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := f(out, rep); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// chartsCmd is `cube-bench charts`: the charts of a JSON report, drawn
// again without running anything (and its Markdown, when asked, so the
// charts are embedded).
func chartsCmd(args []string) error {
	fs := flag.NewFlagSet("cube-bench charts", flag.ExitOnError)
	from := fs.String("from", "bench/results.json", "JSON report to draw (--json-out of a run)")
	md := fs.String("markdown", "", "also rewrite this Markdown report from the JSON, with the charts embedded")
	dir := fs.String("dir", "", "where the SVG files go (default: next to --markdown, else next to --from)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("charts: unexpected arguments %q", fs.Args())
	}
	b, err := os.ReadFile(*from)
	if err != nil {
		return err
	}
	var rep report.Report
	if err := json.Unmarshal(b, &rep); err != nil {
		return fmt.Errorf("%s: %w", *from, err)
	}
	// The targets as defined now, against the run's figures.
	rep.Targets = report.Evaluate(&rep)
	out, prefix := *dir, charts.Prefix(*from)
	if *md != "" {
		prefix = charts.Prefix(*md)
	}
	if out == "" {
		out = filepath.Dir(*from)
		if *md != "" {
			out = filepath.Dir(*md)
		}
	}
	if err := charts.Write(out, prefix, &rep); err != nil {
		return err
	}
	for _, c := range rep.Charts {
		fmt.Println(filepath.Join(out, c.File))
	}
	for _, n := range rep.ChartNotes {
		fmt.Fprintln(os.Stderr, "cube-bench charts:", n)
	}
	if *md == "" {
		return nil
	}
	if *dir != "" {
		// The Markdown links the charts relative to itself.
		for i := range rep.Charts {
			rel, err := filepath.Rel(filepath.Dir(*md), filepath.Join(out, rep.Charts[i].File))
			if err != nil {
				return err
			}
			rep.Charts[i].File = filepath.ToSlash(rel)
		}
	}
	return write(*md, &rep, report.WriteMarkdown)
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "cube-bench:", err)
	os.Exit(1)
}
