// Package sysinfo measures the sandbox the agent runs in: CPU, memory and
// disk, as envd's GET /metrics reports them.
//
// Inside a container the sandbox's limits live in its cgroup (the runtime
// gives it a cgroup namespace, so its own cgroup is the root of what it
// sees under /sys/fs/cgroup); /proc/meminfo and the CPU count there are the
// host's. So cgroup files come first, v2 or v1, and the host-wide sources
// are the fallback (a VM, where the guest kernel is the sandbox's own).
package sysinfo

import (
	"bufio"
	"bytes"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Metrics is envd's /metrics body.
type Metrics struct {
	Ts          int64   `json:"ts"`
	CPUCount    int     `json:"cpu_count"`
	CPUUsedPct  float32 `json:"cpu_used_pct"`
	MemTotal    uint64  `json:"mem_total"`
	MemUsed     uint64  `json:"mem_used"`
	MemTotalMiB uint64  `json:"mem_total_mib"`
	MemUsedMiB  uint64  `json:"mem_used_mib"`
	MemCache    uint64  `json:"mem_cache"`
	DiskUsed    uint64  `json:"disk_used"`
	DiskTotal   uint64  `json:"disk_total"`
}

// Sampler computes CPU usage between calls; its zero value is ready.
type Sampler struct {
	Root     string // cgroup mount, /sys/fs/cgroup when empty
	DiskPath string // filesystem to report, / when empty

	mu       sync.Mutex
	lastAt   time.Time
	lastUsed time.Duration
}

func (s *Sampler) root() string {
	if s.Root == "" {
		return "/sys/fs/cgroup"
	}
	return s.Root
}

// Collect measures now. The first call samples CPU over 100ms; later calls
// report the average since the previous one.
func (s *Sampler) Collect() Metrics {
	m := Metrics{Ts: time.Now().Unix()}
	m.CPUCount = s.cpuCount()
	m.CPUUsedPct = s.cpuPercent(m.CPUCount)
	m.MemTotal, m.MemUsed, m.MemCache = s.memory()
	m.MemTotalMiB, m.MemUsedMiB = m.MemTotal>>20, m.MemUsed>>20
	disk := s.DiskPath
	if disk == "" {
		disk = "/"
	}
	var st unix.Statfs_t
	if unix.Statfs(disk, &st) == nil {
		m.DiskTotal = st.Blocks * uint64(st.Bsize)
		m.DiskUsed = (st.Blocks - st.Bfree) * uint64(st.Bsize)
	}
	return m
}

func (s *Sampler) v2() bool {
	_, err := os.Stat(filepath.Join(s.root(), "cgroup.controllers"))
	return err == nil
}

// cpuCount is the CPU limit rounded up, or the CPUs we may run on.
func (s *Sampler) cpuCount() int {
	n := runtime.NumCPU()
	var quota, period float64
	if s.v2() {
		f := strings.Fields(readString(filepath.Join(s.root(), "cpu.max")))
		if len(f) == 2 && f[0] != "max" {
			quota, _ = strconv.ParseFloat(f[0], 64)
			period, _ = strconv.ParseFloat(f[1], 64)
		}
	} else {
		dir := s.v1("cpu")
		quota, _ = strconv.ParseFloat(readString(filepath.Join(dir, "cpu.cfs_quota_us")), 64)
		period, _ = strconv.ParseFloat(readString(filepath.Join(dir, "cpu.cfs_period_us")), 64)
	}
	if quota > 0 && period > 0 {
		if limit := int(math.Ceil(quota / period)); limit < n {
			return max(limit, 1)
		}
	}
	return n
}

// v1 finds a v1 controller's directory (cpu may be mounted as cpu,cpuacct).
func (s *Sampler) v1(controller string) string {
	for _, name := range []string{controller, "cpu,cpuacct", "cpuacct,cpu"} {
		dir := filepath.Join(s.root(), name)
		if _, err := os.Stat(dir); err == nil {
			return dir
		}
	}
	return filepath.Join(s.root(), controller)
}

// cpuUsed is the CPU time the sandbox has consumed, and whether it could
// be read.
func (s *Sampler) cpuUsed() (time.Duration, bool) {
	if s.v2() {
		for line := range strings.SplitSeq(readString(filepath.Join(s.root(), "cpu.stat")), "\n") {
			if v, ok := strings.CutPrefix(line, "usage_usec "); ok {
				us, err := strconv.ParseInt(v, 10, 64)
				return time.Duration(us) * time.Microsecond, err == nil
			}
		}
		return 0, false
	}
	ns, err := strconv.ParseInt(readString(filepath.Join(s.v1("cpuacct"), "cpuacct.usage")), 10, 64)
	return time.Duration(ns), err == nil
}

func (s *Sampler) cpuPercent(cpus int) float32 {
	s.mu.Lock()
	defer s.mu.Unlock()
	used, ok := s.cpuUsed()
	if !ok {
		return 0
	}
	now := time.Now()
	if s.lastAt.IsZero() {
		s.lastAt, s.lastUsed = now, used
		time.Sleep(100 * time.Millisecond)
		if used, ok = s.cpuUsed(); !ok {
			return 0
		}
		now = time.Now()
	}
	wall := now.Sub(s.lastAt)
	delta := used - s.lastUsed
	s.lastAt, s.lastUsed = now, used
	if wall <= 0 || delta < 0 {
		return 0
	}
	pct := float64(delta) / float64(wall) / float64(cpus) * 100
	return float32(math.Min(pct, 100))
}

// memory returns the limit, the usage without reclaimable page cache,
// and the page cache.
func (s *Sampler) memory() (total, used, cache uint64) {
	hostTotal := meminfo("MemTotal")
	var limit, usage, inactive uint64
	if s.v2() {
		limit = readUint(filepath.Join(s.root(), "memory.max"))
		usage = readUint(filepath.Join(s.root(), "memory.current"))
		stat := keyed(filepath.Join(s.root(), "memory.stat"))
		cache, inactive = stat["file"], stat["inactive_file"]
	} else {
		dir := s.v1("memory")
		limit = readUint(filepath.Join(dir, "memory.limit_in_bytes"))
		usage = readUint(filepath.Join(dir, "memory.usage_in_bytes"))
		stat := keyed(filepath.Join(dir, "memory.stat"))
		cache, inactive = stat["total_cache"], stat["total_inactive_file"]
	}
	total = hostTotal
	if limit > 0 && (hostTotal == 0 || limit < hostTotal) {
		total = limit
	}
	if usage == 0 {
		// No cgroup to ask (a VM): the guest's own accounting.
		avail := meminfo("MemAvailable")
		cache = meminfo("Cached")
		if hostTotal > avail {
			usage = hostTotal - avail
		}
		return total, usage, cache
	}
	if usage > inactive {
		used = usage - inactive
	}
	return total, used, cache
}

func readString(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// readUint reads a number; "max" and garbage read as 0 (no limit).
func readUint(path string) uint64 {
	v, _ := strconv.ParseUint(readString(path), 10, 64)
	return v
}

func keyed(path string) map[string]uint64 {
	out := map[string]uint64{}
	for line := range strings.SplitSeq(readString(path), "\n") {
		k, v, ok := strings.Cut(line, " ")
		if !ok {
			continue
		}
		if n, err := strconv.ParseUint(v, 10, 64); err == nil {
			out[k] = n
		}
	}
	return out
}

// meminfo reads one /proc/meminfo field in bytes.
func meminfo(field string) uint64 {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok || k != field {
			continue
		}
		f := strings.Fields(v)
		if len(f) == 0 {
			return 0
		}
		n, _ := strconv.ParseUint(f[0], 10, 64)
		return n << 10
	}
	return 0
}
