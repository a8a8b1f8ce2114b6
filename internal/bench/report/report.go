// Package report is cube-bench's report model and its rendering: what a
// run measured (results, statistics, comparisons with the raw baselines,
// density, the machine it ran on, the options it ran with), the
// performance targets checked against it, and the table, Markdown
// (bench/RESULTS.md) and JSON forms. It links nothing of the module: the
// runner in package bench fills it in.
package report

import (
	"fmt"
	"time"
)

// Report is one run of cube-bench: what ran, where, and what came out.
type Report struct {
	RunID    string    `json:"run_id"`
	Command  string    `json:"command"`
	Started  time.Time `json:"started"`
	Finished time.Time `json:"finished"`
	Machine  Machine   `json:"machine"`
	Options  Options   `json:"options"`
	Results  []*Result `json:"results"`
	Targets  []Target  `json:"targets"`
	Notes    []string  `json:"notes,omitempty"`
	// Charts are the chart files drawn from this report (package
	// charts), relative to the Markdown file that embeds them.
	Charts []Chart `json:"-"`
	// ChartNotes say which charts could not be drawn, and why.
	ChartNotes []string `json:"-"`
}

// Chart is one chart file to embed in the Markdown report.
type Chart struct {
	Section string // "Latency CDFs", ...: consecutive charts of one section share a heading
	Title   string
	File    string // path relative to the Markdown file
	Caption string // what the chart shows, under it
}

// Machine describes where a run happened: absolute figures only mean
// something next to it (and ratios next to the load it was under).
type Machine struct {
	Hostname    string `json:"hostname"`
	CPUs        int    `json:"cpus"`
	CPUModel    string `json:"cpu_model"`
	MemoryBytes Bytes  `json:"memory_bytes"`
	Kernel      string `json:"kernel"`
	OS          string `json:"os"`
	Runc        string `json:"runc"`
	Podman      string `json:"podman,omitempty"`
	Go          string `json:"go"`
	Cgroups     string `json:"cgroups"`
	KVM         bool   `json:"kvm"`
	Storage     string `json:"storage,omitempty"` // cubelet's pool mode
	// Runtime is the runtime the run creates with and what its driver
	// says of itself ("vm (accel=tcg channel=virtio-serial)").
	Runtime   string `json:"runtime,omitempty"`
	LoadStart string `json:"load_start"`
	LoadEnd   string `json:"load_end"`
}

// Bytes is a memory size.
type Bytes int64

// MiB renders b in MiB with two decimals.
func (b Bytes) MiB() string { return fmt.Sprintf("%.2f MiB", float64(b)/(1<<20)) }

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
	// OwnPSS is PSS less the processes' Pss_Shmem: what a VM clone owns
	// beyond its share of the template's pages (0 in runs from before
	// it was recorded).
	OwnPSS    Stats[Bytes] `json:"own_pss,omitzero"`
	DiskCache Stats[Bytes] `json:"disk_cache"`
	// LoopDirectIO: the loop devices read their image with O_DIRECT, so
	// DiskCache stays empty by construction.
	LoopDirectIO bool  `json:"loop_direct_io"`
	CubeletRSS   Bytes `json:"cubelet_rss"`
	CubeletPSS   Bytes `json:"cubelet_pss,omitempty"`
	// NetworkAgentRSS is network-agent's RSS when it ran as its own
	// process (--density-net); 0 otherwise.
	NetworkAgentRSS Bytes `json:"network_agent_rss,omitempty"`
	// NodePerSandbox is the drop of the host's MemAvailable while the
	// sandboxes started, divided by their number: everything at once
	// (loop devices, mounts, slab), but noisy on a shared machine.
	NodePerSandbox Bytes `json:"node_per_sandbox"`
	// Fill is the create latency while the node filled up.
	Fill Summary `json:"fill_latency"`
	// Growth is what the host paid as the node filled: a point after
	// each tenth of the sandboxes started (not settled: measured as
	// soon as that tenth is up), the last one the settled figures
	// above. Package charts draws memory against sandboxes from it.
	Growth []DensityPoint `json:"growth,omitempty"`
	// Health is every sandbox's envd /health asked through the sandbox
	// proxy once all were up and measured; nil when not asked.
	Health *HealthCheck `json:"health,omitempty"`
}

// HealthCheck is /health asked of each of a node's sandboxes, one at a
// time, through the sandbox proxy.
type HealthCheck struct {
	Asked  int `json:"asked"`
	Failed int `json:"failed"`
	// Late answered, but after Within.
	Late    int           `json:"late"`
	Within  time.Duration `json:"within_ns"`
	Latency Summary       `json:"latency"`
	// FirstError is the first failure's error, "" without one.
	FirstError string `json:"first_error,omitempty"`
}

// DensityPoint is the node with Sandboxes idle sandboxes up.
type DensityPoint struct {
	Sandboxes int `json:"sandboxes"`
	// Measured is how many sandboxes Total averages over: a spread of
	// at most 20 of those up at the checkpoints, all of them at the end.
	Measured int `json:"measured"`
	// Total is the average of charged + disk image page cache per
	// sandbox (DensityReport.Total).
	Total Bytes `json:"total"`
	// NodePerSandbox is the drop of MemAvailable since the fill began,
	// over Sandboxes.
	NodePerSandbox Bytes `json:"node_per_sandbox"`
	CubeletRSS     Bytes `json:"cubelet_rss"`
	// Settled: taken after --density-settle (the final point).
	Settled bool `json:"settled,omitempty"`
}
