package report

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
)

// fmtMS renders a latency in milliseconds, with more digits below 1 ms
// (freezer writes are tens of microseconds).
func fmtMS(d time.Duration) string {
	ms := float64(d) / 1e6
	if ms < 1 {
		return fmt.Sprintf("%.3f", ms)
	}
	return fmt.Sprintf("%.2f", ms)
}

func fmtRatio(r float64) string {
	if r == 0 {
		return "-"
	}
	return fmt.Sprintf("%.2fx", r)
}

func fmtDelta(d time.Duration) string { return fmt.Sprintf("%+.2f ms", float64(d)/1e6) }

// WriteJSON writes the report as indented JSON.
func WriteJSON(w io.Writer, rep *Report) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(rep)
}

// latencyRows renders the latency table (header first).
func latencyRows(rep *Report) [][]string {
	rows := [][]string{{"scenario", "kind", "n", "c", "min", "avg", "std", "p50", "p90", "p95", "p99", "max", "failed", "ops/s"}}
	for _, r := range rep.Results {
		if r.Latency == nil {
			continue
		}
		s := r.Latency
		thr := "-"
		if r.Wall > 0 && s.N > 0 {
			thr = fmt.Sprintf("%.1f", float64(s.N)/r.Wall.Seconds())
		}
		rows = append(rows, []string{r.Scenario, string(r.Kind), fmt.Sprint(s.N), fmt.Sprint(r.Params.Concurrency),
			fmtMS(s.Min), fmtMS(s.Avg), fmtMS(s.Std), fmtMS(s.P50), fmtMS(s.P90), fmtMS(s.P95), fmtMS(s.P99), fmtMS(s.Max),
			fmt.Sprint(r.Failed), thr})
	}
	return rows
}

func compareRows(rep *Report) [][]string {
	rows := [][]string{{"scenario", "baseline", "avg ratio", "p50 ratio", "p99 ratio", "avg delta", "p50 delta"}}
	for _, r := range rep.Results {
		for _, c := range r.Compare {
			if c.Skipped != "" {
				rows = append(rows, []string{r.Scenario, c.Baseline, "-", "-", "-", "-", "skipped: " + c.Skipped})
				continue
			}
			rows = append(rows, []string{r.Scenario, c.Baseline, fmtRatio(c.RatioAvg), fmtRatio(c.RatioP50), fmtRatio(c.RatioP99), fmtDelta(c.DeltaAvg), fmtDelta(c.DeltaP50)})
		}
	}
	return rows
}

// actionRows breaks cube scenarios down by cubelet action; "outside
// actions" is the RPC's average minus the actions' averages summed per
// step (parallel actions of one step count once, by their longest).
func actionRows(rep *Report) [][]string {
	rows := [][]string{{"scenario", "action", "avg", "p50", "p99", "share of avg"}}
	for _, r := range rep.Results {
		if len(r.Actions) == 0 || r.Latency == nil || r.Latency.Avg <= 0 {
			continue
		}
		stepMax := map[string]time.Duration{}
		for _, a := range r.Actions {
			rows = append(rows, []string{r.Scenario, a.Action, fmtMS(a.Latency.Avg), fmtMS(a.Latency.P50), fmtMS(a.Latency.P99),
				fmt.Sprintf("%.0f%%", 100*float64(a.Latency.Avg)/float64(r.Latency.Avg))})
			step := a.Action[:strings.LastIndex(a.Action, "/")]
			stepMax[step] = max(stepMax[step], a.Latency.Avg)
		}
		var in time.Duration
		for _, d := range stepMax {
			in += d
		}
		out := r.Latency.Avg - in
		rows = append(rows, []string{r.Scenario, "(outside actions: gRPC, store, engine)", fmtMS(out), "", "",
			fmt.Sprintf("%.0f%%", 100*float64(out)/float64(r.Latency.Avg))})
	}
	return rows
}

func densityRows(d *DensityReport) [][]string {
	rows := [][]string{{"per sandbox", "min", "avg", "p50", "p90", "p99", "max"}}
	for _, x := range []struct {
		name string
		s    Stats[Bytes]
		opt  bool // left out when not measured (older reports)
	}{
		{"total (charged + disk cache)", d.Total, false},
		{"cgroup charged", d.Charged, false},
		{"  anon", d.Anon, false},
		{"  page cache (file)", d.File, false},
		{"  kernel", d.Kernel, false},
		{"processes PSS", d.PSS, false},
		{"processes RSS", d.RSS, false},
		{"processes PSS beyond shared memory", d.OwnPSS, true},
		{"disk image page cache", d.DiskCache, false},
	} {
		if x.opt && x.s.N == 0 {
			continue
		}
		rows = append(rows, []string{x.name, x.s.Min.MiB(), x.s.Avg.MiB(), x.s.P50.MiB(), x.s.P90.MiB(), x.s.P99.MiB(), x.s.Max.MiB()})
	}
	return rows
}

// densityTitle heads a density scenario's section: what it started.
func densityTitle(scenario string, n int) string {
	if scenario == "density-clones" {
		return fmt.Sprintf("Density of clones: %d idle clones of one warm template", n)
	}
	return fmt.Sprintf("Density: %d idle sandboxes", n)
}

// healthLine says how the sandboxes answered /health through the proxy.
func healthLine(h *HealthCheck) string {
	l := fmt.Sprintf("envd /health through the sandbox proxy, each sandbox once: %d asked, %d failed, %d later than %s; avg %s ms, P50 %s, P99 %s, max %s",
		h.Asked, h.Failed, h.Late, h.Within, fmtMS(h.Latency.Avg), fmtMS(h.Latency.P50), fmtMS(h.Latency.P99), fmtMS(h.Latency.Max))
	if h.FirstError != "" {
		l += "; first failure: " + h.FirstError
	}
	return l
}

func targetRows(rep *Report) [][]string {
	rows := [][]string{{"target", "want", "got", "met"}}
	for _, t := range rep.Targets {
		m := "-"
		if t.Met != nil {
			m = map[bool]string{true: "yes", false: "NO"}[*t.Met]
		}
		rows = append(rows, []string{t.Name, t.Want, t.Got, m})
	}
	return rows
}

func skipRows(rep *Report) []string {
	var out []string
	for _, r := range rep.Results {
		switch {
		case r.Skipped != "":
			out = append(out, fmt.Sprintf("%s: %s", r.Scenario, r.Skipped))
		case r.Error != "":
			out = append(out, fmt.Sprintf("%s: FAILED: %s", r.Scenario, r.Error))
		}
		for _, n := range r.Notes {
			out = append(out, fmt.Sprintf("%s: %s", r.Scenario, n))
		}
	}
	return append(out, rep.Notes...)
}

// WriteTable writes the report as aligned text tables.
func WriteTable(w io.Writer, rep *Report) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	table := func(title string, rows [][]string) {
		if len(rows) < 2 {
			return
		}
		fmt.Fprintf(tw, "\n%s\n", title)
		for i, r := range rows {
			if i == 0 {
				r = upper(r)
			}
			fmt.Fprintln(tw, strings.Join(r, "\t"))
		}
		tw.Flush()
	}
	m := rep.Machine
	fmt.Fprintf(tw, "cube-bench %s  %s  %d CPUs  %s  kernel %s  %s  runtime %s  load %s -> %s\n",
		rep.RunID, rep.Started.Format(time.RFC3339), m.CPUs, m.MemoryBytes.MiB(), m.Kernel, m.Runc, m.Runtime, m.LoadStart, m.LoadEnd)
	table("LATENCY (ms)", latencyRows(rep))
	table("COMPARED WITH RAW BASELINES (ours / baseline, ours - baseline)", compareRows(rep))
	table("WHERE CUBELET SPENDS IT (action timings returned by the RPCs, ms)", actionRows(rep))
	for _, r := range rep.Results {
		if d := r.Density; d != nil {
			head, rest, _ := strings.Cut(densityTitle(r.Scenario, d.Sandboxes), ":")
			table(fmt.Sprintf("%s:%s, %d processes", strings.ToUpper(head), rest, d.Processes), densityRows(d))
			fmt.Fprintf(tw, "cubelet RSS %s (PSS %s); host MemAvailable drop per sandbox %s; loop direct I/O %v\n",
				d.CubeletRSS.MiB(), d.CubeletPSS.MiB(), d.NodePerSandbox.MiB(), d.LoopDirectIO)
			if d.NetworkAgentRSS > 0 {
				fmt.Fprintf(tw, "network-agent RSS %s (every sandbox has a network slot)\n", d.NetworkAgentRSS.MiB())
			}
			if h := d.Health; h != nil {
				fmt.Fprintln(tw, healthLine(h))
			}
		}
	}
	table("TARGETS", targetRows(rep))
	if s := skipRows(rep); len(s) > 0 {
		fmt.Fprintf(tw, "\nNOTES\n")
		for _, l := range s {
			fmt.Fprintln(tw, "  "+l)
		}
	}
	for _, r := range rep.Results {
		if len(r.Profiles) > 0 {
			fmt.Fprintf(tw, "profiles of %s: %d files in %s\n", r.Scenario, len(r.Profiles), dirOf(r.Profiles[0]))
		}
	}
	return tw.Flush()
}

func upper(r []string) []string {
	out := make([]string, len(r))
	for i, s := range r {
		out[i] = strings.ToUpper(s)
	}
	return out
}

func dirOf(p string) string {
	if i := strings.LastIndex(p, "/"); i > 0 {
		return p[:i]
	}
	return "."
}

// WriteMarkdown writes the report as bench/RESULTS.md.
func WriteMarkdown(w io.Writer, rep *Report) error {
	var b strings.Builder
	table := func(rows [][]string) {
		for i, r := range rows {
			b.WriteString("| " + strings.Join(r, " | ") + " |\n")
			if i == 0 {
				b.WriteString("|" + strings.Repeat(" --- |", len(r)) + "\n")
			}
		}
		b.WriteString("\n")
	}
	m := rep.Machine
	b.WriteString("# cube-bench results\n\n")
	b.WriteString("Generated by `make bench` (cmd/cube-bench); do not edit by hand. How to read these figures, what each\n")
	b.WriteString("scenario and baseline measures, and what bounds the targets that are missed: [docs/bench.md](../docs/bench.md).\n\n")
	fmt.Fprintf(&b, "- **Command**: `%s`\n", rep.Command)
	fmt.Fprintf(&b, "- **Date**: %s (took %s)\n", rep.Started.Format(time.RFC3339), rep.Finished.Sub(rep.Started).Round(time.Second))
	fmt.Fprintf(&b, "- **Machine**: %d CPUs (%s), %s memory, kernel %s, %s, cgroups %s, KVM %v\n",
		m.CPUs, m.CPUModel, m.MemoryBytes.MiB(), m.Kernel, m.OS, m.Cgroups, m.KVM)
	fmt.Fprintf(&b, "- **Software**: %s; %s; %s; cubelet storage pool: %s", m.Runc, orNone(m.Podman), m.Go, m.Storage)
	if m.Runtime != "" { // reports from before it was recorded
		fmt.Fprintf(&b, "; runtime: %s", m.Runtime)
	}
	b.WriteString("\n")
	fmt.Fprintf(&b, "- **Load average** (shared machine): %s at start, %s at end\n\n", m.LoadStart, m.LoadEnd)
	b.WriteString("## Targets\n\n")
	table(targetRows(rep))
	b.WriteString("## Latency (ms)\n\n")
	table(latencyRows(rep))
	b.WriteString("## Compared with the raw baselines\n\nRatio = ours / baseline; delta = ours - baseline (what cube adds).\n\n")
	table(compareRows(rep))
	b.WriteString("## Where cubelet spends it\n\nPer workflow action, from the timings each RPC returns (ms). \"Outside actions\" is the RPC's average\nminus the actions (gRPC, validation, state store writes, engine).\n\n")
	table(actionRows(rep))
	for _, r := range rep.Results {
		if d := r.Density; d != nil {
			fmt.Fprintf(&b, "## %s\n\n", densityTitle(r.Scenario, d.Sandboxes))
			table(densityRows(d))
			fmt.Fprintf(&b, "Processes in the sandboxes' cgroups: %d. Cubelet RSS %s (PSS %s). Host MemAvailable drop per sandbox %s. Loop devices with direct I/O: %v. Create latency while filling: avg %s ms, P99 %s ms.\n\n",
				d.Processes, d.CubeletRSS.MiB(), d.CubeletPSS.MiB(), d.NodePerSandbox.MiB(), d.LoopDirectIO, fmtMS(d.Fill.Avg), fmtMS(d.Fill.P99))
			if d.NetworkAgentRSS > 0 {
				fmt.Fprintf(&b, "network-agent RSS %s (every sandbox has a network slot).\n\n", d.NetworkAgentRSS.MiB())
			}
			if h := d.Health; h != nil {
				fmt.Fprintf(&b, "%s.\n\n", healthLine(h))
			}
		}
	}
	writeCharts(&b, rep)
	if s := skipRows(rep); len(s) > 0 {
		b.WriteString("## Skipped, failed, notes\n\n")
		for _, l := range s {
			b.WriteString("- " + l + "\n")
		}
		b.WriteString("\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// writeCharts embeds the report's charts, a heading per section.
func writeCharts(b *strings.Builder, rep *Report) {
	if len(rep.Charts) == 0 && len(rep.ChartNotes) == 0 {
		return
	}
	b.WriteString("## Charts\n\n")
	b.WriteString("Drawn from the JSON report (`cube-bench charts --from` redraws them without running anything).\n\n")
	section := ""
	for _, c := range rep.Charts {
		if c.Section != section {
			section = c.Section
			fmt.Fprintf(b, "### %s\n\n", section)
		}
		fmt.Fprintf(b, "![%s](%s)\n\n", c.Title, c.File)
		if c.Caption != "" {
			b.WriteString(c.Caption + "\n\n")
		}
	}
	for _, n := range rep.ChartNotes {
		b.WriteString("- " + n + "\n")
	}
	if len(rep.ChartNotes) > 0 {
		b.WriteString("\n")
	}
}

func orNone(s string) string {
	if s == "" {
		return "podman not installed"
	}
	return s
}
