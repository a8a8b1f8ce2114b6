package bench

import (
	"context"
	"errors"
	"fmt"
	"time"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
)

// DensityReport is what N idle sandboxes cost the host. Per-sandbox
// figures are Stats over the sandboxes:
//
//	Total     = Charged + DiskCache: the headline "host memory per sandbox"
//	Charged   everything the memory cgroup of the sandbox is charged with
//	          (v1 memory.usage_in_bytes, v2 memory.current) = Anon + File +
//	          kernel memory; the agent's own pages are in here
//	PSS, RSS  of every process in the sandbox's cgroup (smaps_rollup); a
//	          view of the same pages from the process side, not added again
//	DiskCache page cache of the sandbox's disk image on the host (the file
//	          behind its loop device), which the kernel charges to whoever
//	          read it first, typically not the sandbox
//
// runc leaves no per-sandbox shim running (runc exits after `run -d`), so
// there is no shim term. Cubelet is shared by all sandboxes and reported
// on its own.
type DensityReport struct {
	Sandboxes int          `json:"sandboxes"`
	Processes int          `json:"processes"`
	Total     Stats[Bytes] `json:"total"`
	Charged   Stats[Bytes] `json:"charged"`
	Anon      Stats[Bytes] `json:"anon"`
	File      Stats[Bytes] `json:"file"`
	Kernel    Stats[Bytes] `json:"kernel"`
	PSS       Stats[Bytes] `json:"pss"`
	RSS       Stats[Bytes] `json:"rss"`
	DiskCache Stats[Bytes] `json:"disk_cache"`
	// LoopDirectIO: the loop devices read their image with O_DIRECT, so
	// DiskCache stays empty by construction.
	LoopDirectIO bool  `json:"loop_direct_io"`
	CubeletRSS   Bytes `json:"cubelet_rss"`
	CubeletPSS   Bytes `json:"cubelet_pss,omitempty"`
	// NodePerSandbox is the drop of the host's MemAvailable while the
	// sandboxes started, divided by their number: everything at once
	// (loop devices, mounts, slab), but noisy on a shared machine.
	NodePerSandbox Bytes `json:"node_per_sandbox"`
	// Fill is the create latency while the node filled up.
	Fill Summary `json:"fill_latency"`
}

func init() {
	Register(Scenario{
		Name: "density", Kind: KindCube,
		Help:   "start --density-n idle sandboxes; host memory per sandbox and cubelet's RSS",
		Params: func(o Options) Params { return Params{N: o.DensityN, Concurrency: o.DensityConcurrency} },
		Run:    runDensity,
	})
}

// sandboxMem is one sandbox's measurement.
type sandboxMem struct {
	cg        cgroupMem
	procs     int
	pss, rss  Bytes
	diskCache Bytes
	dio       bool
}

func measureSandbox(pid int) (sandboxMem, error) {
	var m sandboxMem
	dir, v2, err := cgroupDir(pid, "memory")
	if err != nil {
		return m, err
	}
	if m.cg, err = readCgroupMem(dir, v2); err != nil {
		return m, err
	}
	pids, err := cgroupProcs(dir)
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

func runDensity(ctx context.Context, e *Env, p Params) (*Result, error) {
	before, err := memAvailable()
	if err != nil {
		return nil, err
	}
	var fill []time.Duration
	ids, err := e.fillTimed(ctx, "density: start", p.N, p.Concurrency, &fill)
	if err != nil {
		return nil, err
	}
	rep, err := func() (*DensityReport, error) {
		e.Progress.Note("density: %d sandboxes up; settling %s", len(ids), e.Opts.DensitySettle)
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(e.Opts.DensitySettle):
		}
		e.peak(ctx)
		var total, charged, anon, file, kernel, pss, rss, disk []Bytes
		rep := &DensityReport{Sandboxes: len(ids), Fill: Summarize(fill)}
		e.Progress.Start("density: measure", len(ids))
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
		rep.NodePerSandbox = (before - after) / Bytes(len(ids))
		rep.Total, rep.Charged, rep.Anon, rep.File = Summarize(total), Summarize(charged), Summarize(anon), Summarize(file)
		rep.Kernel, rep.PSS, rep.RSS, rep.DiskCache = Summarize(kernel), Summarize(pss), Summarize(rss), Summarize(disk)
		if rep.CubeletRSS, rep.CubeletPSS, err = e.cubeletRSS(ctx); err != nil {
			return nil, err
		}
		return rep, nil
	}()
	if derr := e.deleteAll(ctx, "density: cleanup", ids, p.Concurrency); derr != nil {
		err = errors.Join(err, derr)
	}
	if err != nil {
		return nil, err
	}
	return &Result{Scenario: "density", Kind: KindCube, Params: p, Density: rep}, nil
}
