package bench

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/bench/raw"
	"github.com/cubesandbox/cube/internal/bench/report"
)

func init() {
	Register(Scenario{
		Name: "density", Kind: report.KindCube,
		Help: "start --density-n idle sandboxes; host memory per sandbox, cubelet's RSS, then each one's /health through the proxy",
		Params: func(o report.Options) report.Params {
			return report.Params{N: o.DensityN, Concurrency: o.DensityConcurrency}
		},
		Run: func(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
			return runDensity(ctx, e, p, "density", e.Opts.Template, false)
		},
	})
	Register(Scenario{
		Name: "density-clones", Kind: report.KindCube,
		Help: "density with --density-n clones of a warmed template (WarmTemplate once, untimed; gvisor, vm): what a restored clone costs beside the others, Pss of shared memory apart (on vm the template's pages)",
		Params: func(o report.Options) report.Params {
			return report.Params{N: o.DensityN, Concurrency: o.DensityConcurrency}
		},
		Probe: memoryRuntime,
		Run: func(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
			w, err := e.warm(ctx)
			if err != nil {
				return nil, err
			}
			return runDensity(ctx, e, p, "density-clones", w.id, true)
		},
	})
}

// sandboxMem is one sandbox's measurement.
type sandboxMem struct {
	cg        cgroupMem
	procs     int
	pss, rss  report.Bytes
	pssShmem  report.Bytes
	diskCache report.Bytes
	dio       bool
}

func measureSandbox(pid int) (sandboxMem, error) {
	var m sandboxMem
	dir, v2, err := raw.CgroupDir(pid, "memory")
	if err != nil {
		return m, err
	}
	if m.cg, err = readCgroupMem(dir, v2); err != nil {
		return m, err
	}
	pids, err := raw.CgroupProcs(dir)
	if err != nil {
		return m, err
	}
	for _, p := range pids {
		pm, err := readProcMem(p)
		if err != nil {
			continue // exited meanwhile
		}
		m.procs++
		m.pss += pm.pss
		m.rss += pm.rss
		m.pssShmem += pm.pssShmem
	}
	_, backing, dio, err := rootLoop(pid)
	if err != nil {
		return m, err
	}
	m.dio = dio
	if backing != "" {
		if m.diskCache, err = pageCached(backing); err != nil {
			return m, err
		}
	}
	return m, nil
}

// densitySteps is how many parts density fills the node in, a growth
// point after each but the last; densitySpread how many of the sandboxes
// up a growth point measures (spread over them, oldest to newest), so the
// points cost the fill little at 10,000 sandboxes.
const (
	densitySteps  = 10
	densitySpread = 20
)

// densityPoint measures the node with ids up, unsettled: the average
// total of a spread of them, MemAvailable's drop since before, cubelet's
// RSS.
func (e *Env) densityPoint(ctx context.Context, ids []string, before report.Bytes) (report.DensityPoint, error) {
	pt := report.DensityPoint{Sandboxes: len(ids)}
	k := min(len(ids), densitySpread)
	var sum report.Bytes
	for i := range k {
		id := ids[report.ThinRank(i, len(ids), k)]
		sb, err := e.Client.GetSandbox(ctx, &pb.GetSandboxRequest{SandboxId: id})
		if err != nil {
			return pt, err
		}
		m, err := measureSandbox(int(sb.Sandbox.Pid))
		if err != nil {
			return pt, fmt.Errorf("measure sandbox %s: %w", id, err)
		}
		sum += m.cg.charged + m.diskCache
	}
	if k > 0 {
		pt.Measured, pt.Total = k, sum/report.Bytes(k)
	}
	after, err := memAvailable()
	if err != nil {
		return pt, err
	}
	if len(ids) > 0 {
		pt.NodePerSandbox = (before - after) / report.Bytes(len(ids))
	}
	if pt.CubeletRSS, _, err = e.cubeletRSS(ctx); err != nil {
		return pt, err
	}
	return pt, nil
}

// runDensity fills the node with p.N sandboxes of template tmpl (each a
// restore of its warm snapshot when warm) and measures them as scenario.
func runDensity(ctx context.Context, e *Env, p report.Params, scenario, tmpl string, warm bool) (*report.Result, error) {
	before, err := memAvailable()
	if err != nil {
		return nil, err
	}
	// The node fills in tenths, with a growth point after each: what
	// the host pays as sandboxes add up, for the memory chart.
	var (
		fill   []time.Duration
		ids    []string
		growth []report.DensityPoint
		// pace: how the creates went in each tenth, as the node
		// filled (what the sandboxes already up cost a create).
		pace []string
	)
	steps := split(p.N, densitySteps)
	for i, n := range steps {
		var lat []time.Duration
		begin := time.Now()
		part, err := e.fillTimed(ctx, tmpl, warm, fmt.Sprintf("%s: start %d/%d", scenario, i+1, len(steps)), n, p.Concurrency, &lat)
		fill = append(fill, lat...)
		if err != nil {
			return nil, errors.Join(err, e.deleteAll(ctx, scenario+": cleanup", ids, p.Concurrency))
		}
		ids = append(ids, part...)
		if len(lat) > 0 {
			pace = append(pace, fmt.Sprintf("%d: %.1f/s, p50 %s", len(ids),
				float64(len(part))/time.Since(begin).Seconds(), report.Summarize(lat).P50.Round(100*time.Microsecond)))
		}
		if i == len(steps)-1 {
			break
		}
		pt, err := e.densityPoint(ctx, ids, before)
		if err != nil {
			return nil, errors.Join(err, e.deleteAll(ctx, scenario+": cleanup", ids, p.Concurrency))
		}
		growth = append(growth, pt)
	}
	rep, err := func() (*report.DensityReport, error) {
		if use := e.Opts.DensityUse; use > 0 {
			if err := e.useThroughProxy(ctx, ids, use, p.Concurrency); err != nil {
				return nil, err
			}
		}
		e.Progress.Note("%s: %d sandboxes up; settling %s", scenario, len(ids), e.Opts.DensitySettle)
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(e.Opts.DensitySettle):
		}
		e.peak(ctx)
		var total, charged, anon, file, kernel, pss, rss, own, disk []report.Bytes
		rep := &report.DensityReport{Sandboxes: len(ids), Fill: report.Summarize(fill)}
		e.Progress.Start(scenario+": measure", len(ids))
		for _, id := range ids {
			sb, err := e.Client.GetSandbox(ctx, &pb.GetSandboxRequest{SandboxId: id})
			if err != nil {
				return nil, err
			}
			m, err := measureSandbox(int(sb.Sandbox.Pid))
			if err != nil {
				return nil, fmt.Errorf("measure sandbox %s: %w", id, err)
			}
			total = append(total, m.cg.charged+m.diskCache)
			charged = append(charged, m.cg.charged)
			anon = append(anon, m.cg.anon)
			file = append(file, m.cg.file)
			kernel = append(kernel, m.cg.kernel)
			pss = append(pss, m.pss)
			rss = append(rss, m.rss)
			own = append(own, m.pss-m.pssShmem)
			disk = append(disk, m.diskCache)
			rep.Processes += m.procs
			rep.LoopDirectIO = m.dio
			e.Progress.Step(true)
		}
		e.Progress.Finish()
		after, err := memAvailable()
		if err != nil {
			return nil, err
		}
		rep.NodePerSandbox = (before - after) / report.Bytes(len(ids))
		rep.Total, rep.Charged, rep.Anon, rep.File = report.Summarize(total), report.Summarize(charged), report.Summarize(anon), report.Summarize(file)
		rep.Kernel, rep.PSS, rep.RSS, rep.DiskCache = report.Summarize(kernel), report.Summarize(pss), report.Summarize(rss), report.Summarize(disk)
		rep.OwnPSS = report.Summarize(own)
		if rep.CubeletRSS, rep.CubeletPSS, err = e.cubeletRSS(ctx); err != nil {
			return nil, err
		}
		if e.NetworkAgentPID > 0 {
			m, err := readProcMem(e.NetworkAgentPID)
			if err != nil {
				return nil, fmt.Errorf("network-agent memory: %w", err)
			}
			rep.NetworkAgentRSS = m.rss
		}
		growth = append(growth, report.DensityPoint{Sandboxes: len(ids), Measured: len(ids), Total: rep.Total.Avg,
			NodePerSandbox: rep.NodePerSandbox, CubeletRSS: rep.CubeletRSS, Settled: true})
		rep.Growth = growth
		// After the memory is read: an answer leaves buffers behind in
		// the agent, which the figures above are without.
		if rep.Health, err = e.healthThroughProxy(ctx, ids); err != nil {
			return nil, err
		}
		return rep, nil
	}()
	if derr := e.deleteAll(ctx, scenario+": cleanup", ids, p.Concurrency); derr != nil {
		err = errors.Join(err, derr)
	}
	if err != nil {
		return nil, err
	}
	r := &report.Result{Scenario: scenario, Kind: report.KindCube, Params: p, Density: rep}
	if len(pace) > 1 {
		r.Notes = append(r.Notes, fmt.Sprintf("fill by tenths (sandboxes up after it: creates/s at %d in flight, p50 create): %s",
			p.Concurrency, strings.Join(pace, "; ")))
	}
	if use := e.Opts.DensityUse; use > 0 {
		r.Notes = append(r.Notes, fmt.Sprintf("idle after use: each sandbox ran `true` %d times through the proxy (envd process.Start), then the node settled %s before it was measured", use, e.Opts.DensitySettle))
	}
	return r, nil
}
