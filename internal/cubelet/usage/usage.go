// Package usage samples each sandbox's resource use on a node at a fixed
// interval and keeps a bounded history per sandbox: CPU time and its rate,
// memory (used, RSS, page cache, limit) and tasks from the sandbox's
// cgroup, disk use from its filesystem or image, and network bytes from
// the host end of its slot's veth pair.
//
// History is memory only: a ring of the last Keep samples per sandbox
// (fewer when MaxBytes, shared by all, holds less), grown as samples come. A
// restarted cubelet starts every ring afresh from its first tick (the
// cgroup and veth counters are cumulative, so totals stay right; only the
// history before the restart is gone). A sandbox's ring and its Prometheus
// series go when the sandbox leaves the node (Forget, or the next tick
// that no longer lists it): the series on the metrics listener are
// bounded by the sandboxes on the node, never by how many have lived.
package usage

import (
	"context"
	"errors"
	"io/fs"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/runtime/cgroups"
)

// Target is one sandbox as the sampler needs to know it.
type Target struct {
	ID         string
	CgroupPath string
	// MilliCPU is the sandbox's CPU allowance (1000 = one CPU), the base
	// of CPUPct; 0 = the host's CPUs.
	MilliCPU int64
	// FS is a filesystem mounted on the host that is the sandbox's disk
	// (container runtimes), statfs'd for used and total.
	FS string
	// Image is the sandbox's disk image (VM runtimes): its allocated
	// blocks are its use, its size the total. Used when FS is "".
	Image string
	// HostLink is the host end of the sandbox's veth pair, "" for none.
	HostLink string
	// Live is whether the sandbox has processes to sample (running). A
	// target that is not live (paused, creating) keeps its history and
	// its series but gets no new samples.
	Live bool
}

// Sample is a sandbox's resource use at one moment.
type Sample struct {
	At time.Time
	// CPUCount is the sandbox's CPU allowance in whole CPUs (rounded up).
	CPUCount int
	// CPU is the CPU time used since the sandbox's cgroup was made;
	// CPUPct its rate since the previous sample as a percentage of
	// CPUCount CPUs (0 for a ring's first sample).
	CPU    time.Duration
	CPUPct float64
	// Memory: charged to the cgroup (MemUsed), of it anonymous (RSS) and
	// file-backed (Cache), and the limit (0 = none).
	MemUsed, MemRSS, MemCache, MemLimit int64
	Pids                                int64
	DiskUsed, DiskTotal                 int64
	// NetRx and NetTx are the bytes the sandbox received and sent through
	// its slot since the slot was made.
	NetRx, NetTx int64
}

// Config says how often to sample and how much to keep.
type Config struct {
	Interval time.Duration
	Keep     int // samples per sandbox
	// MaxBytes bounds the history of all sandboxes together (0 = no
	// bound): with more sandboxes than MaxBytes holds Keep samples of,
	// each keeps fewer, its newest, so cubelet's memory does not grow
	// with sandboxes times Keep.
	MaxBytes int64
	// Series exports per-sandbox Prometheus series (Collector).
	Series bool
}

// Sampler samples its targets every Interval and keeps their history.
type Sampler struct {
	cfg     Config
	targets func() []Target
	log     *slog.Logger
	sysfs   string // /sys/class/net, replaced by tests

	mu    sync.Mutex
	rings map[string]*ring
}

// New returns a sampler of what targets lists at each tick. It samples
// only once Run runs (or Tick is called).
func New(cfg Config, targets func() []Target, log *slog.Logger) *Sampler {
	if cfg.Keep < 1 {
		cfg.Keep = 1
	}
	if log == nil {
		log = slog.Default()
	}
	return &Sampler{cfg: cfg, targets: targets, log: log, sysfs: "/sys/class/net", rings: map[string]*ring{}}
}

// Interval is how often the sampler samples.
func (s *Sampler) Interval() time.Duration { return s.cfg.Interval }

// Run samples every Interval until ctx ends. An interval of 0 disables
// sampling.
func (s *Sampler) Run(ctx context.Context) {
	if s.cfg.Interval <= 0 {
		return
	}
	t := time.NewTicker(s.cfg.Interval)
	defer t.Stop()
	s.Tick()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			s.Tick()
		}
	}
}

// Tick samples every live target once now, and drops the history of
// sandboxes no longer listed.
func (s *Sampler) Tick() {
	targets := s.targets()
	mounts, err := cgroups.Mounts()
	if err != nil {
		s.log.Warn("usage: cgroup mounts", "err", err)
		return
	}
	listed := make(map[string]bool, len(targets))
	now := time.Now().UTC()
	for _, t := range targets {
		listed[t.ID] = true
		if !t.Live {
			continue
		}
		smp, err := s.sample(mounts, t, now)
		if err != nil {
			// Gone between the listing and the read (destroyed, or
			// paused to disk): the next tick knows.
			if !errors.Is(err, fs.ErrNotExist) {
				s.log.Debug("usage: sample", "sandbox_id", t.ID, "err", err)
			}
			continue
		}
		s.record(t.ID, smp)
	}
	s.mu.Lock()
	for id := range s.rings {
		if !listed[id] {
			delete(s.rings, id)
		}
	}
	s.mu.Unlock()
}

func (s *Sampler) record(id string, smp Sample) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.rings[id]
	if r == nil {
		r = &ring{}
		s.rings[id] = r
	}
	if prev, ok := r.last(); ok && smp.At.After(prev.At) && smp.CPU >= prev.CPU && smp.CPUCount > 0 {
		wall := smp.At.Sub(prev.At)
		smp.CPUPct = math.Round(float64(smp.CPU-prev.CPU)/float64(wall)/float64(smp.CPUCount)*100*100) / 100
	}
	r.push(smp, s.bound())
}

// SampleBytes is what one sample takes in a ring.
const SampleBytes = int64(unsafe.Sizeof(Sample{}))

// bound is how many samples each ring may keep now: Keep, or fewer when
// MaxBytes shared among the rings allows less (never fewer than 2, the
// CPU rate needs the previous sample). Called with mu held.
func (s *Sampler) bound() int {
	if s.cfg.MaxBytes <= 0 || len(s.rings) == 0 {
		return s.cfg.Keep
	}
	fit := s.cfg.MaxBytes / (int64(len(s.rings)) * SampleBytes)
	return int(min(int64(s.cfg.Keep), max(2, fit)))
}

// Forget drops a sandbox's history (it left the node).
func (s *Sampler) Forget(id string) {
	s.mu.Lock()
	delete(s.rings, id)
	s.mu.Unlock()
}

// History returns a sandbox's samples taken in [start, end] (a zero bound
// is open), oldest first; nil when it has none.
func (s *Sampler) History(id string, start, end time.Time) []Sample {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.rings[id]
	if r == nil {
		return nil
	}
	var out []Sample
	for _, smp := range r.all() {
		if (!start.IsZero() && smp.At.Before(start)) || (!end.IsZero() && smp.At.After(end)) {
			continue
		}
		out = append(out, smp)
	}
	return out
}

// Latest returns each sandbox's newest sample.
func (s *Sampler) Latest() map[string]Sample {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]Sample, len(s.rings))
	for id, r := range s.rings {
		if smp, ok := r.last(); ok {
			out[id] = smp
		}
	}
	return out
}

func (s *Sampler) sample(mounts []string, t Target, now time.Time) (Sample, error) {
	st, err := cgroups.ReadStats(mounts, t.CgroupPath)
	if err != nil {
		return Sample{}, err
	}
	cpus := int(math.Ceil(float64(t.MilliCPU) / 1000))
	if cpus <= 0 {
		cpus = runtime.NumCPU()
	}
	smp := Sample{
		At: now, CPUCount: cpus, CPU: st.CPU,
		MemUsed: st.Memory, MemRSS: st.RSS, MemCache: st.Cache, MemLimit: st.MemoryLimit, Pids: st.Pids,
	}
	smp.DiskUsed, smp.DiskTotal = diskUse(t)
	if t.HostLink != "" {
		// The host end counts the other way round: what the sandbox sent
		// arrives (rx) at the host end.
		smp.NetTx = readCounter(filepath.Join(s.sysfs, t.HostLink, "statistics", "rx_bytes"))
		smp.NetRx = readCounter(filepath.Join(s.sysfs, t.HostLink, "statistics", "tx_bytes"))
	}
	return smp, nil
}

// diskUse is the sandbox's disk use and size: its mounted filesystem's,
// or its image's allocated blocks and length. 0, 0 when neither can be
// read.
func diskUse(t Target) (used, total int64) {
	if t.FS != "" {
		var st unix.Statfs_t
		if err := unix.Statfs(t.FS, &st); err == nil {
			bs := st.Bsize
			return int64(st.Blocks-st.Bfree) * bs, int64(st.Blocks) * bs
		}
	}
	if t.Image != "" {
		var st unix.Stat_t
		if err := unix.Stat(t.Image, &st); err == nil {
			return st.Blocks * 512, st.Size
		}
	}
	return 0, 0
}

func readCounter(path string) int64 {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	n, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	return n
}

// ring keeps a sandbox's newest samples, at most the bound it is pushed
// with. It grows as samples come, so a sandbox pays for the history it
// has, not for a full ring from its first tick, and gives back what is
// over a bound that fell (more sandboxes sharing MaxBytes). Once full,
// buf is circular and start is its oldest sample.
type ring struct {
	buf   []Sample
	start int
}

func (r *ring) push(s Sample, bound int) {
	n := len(r.buf)
	if cap(r.buf) > bound {
		all := r.all()
		keep := min(n, bound-1)
		r.buf = append(make([]Sample, 0, bound), all[n-keep:]...)
		r.start = 0
		n = keep
	}
	switch {
	case n == bound:
		r.buf[r.start] = s
		r.start = (r.start + 1) % n
		return
	case n == cap(r.buf) || r.start != 0:
		// Grow, or unroll a ring that was full under a smaller bound.
		all := r.all()
		r.buf = append(make([]Sample, 0, min(bound, max(4, 2*cap(r.buf)))), all...)
		r.start = 0
	}
	r.buf = append(r.buf, s)
}

func (r *ring) last() (Sample, bool) {
	if len(r.buf) == 0 {
		return Sample{}, false
	}
	return r.buf[(r.start+len(r.buf)-1)%len(r.buf)], true
}

// all returns the samples oldest first.
func (r *ring) all() []Sample {
	return append(append([]Sample(nil), r.buf[r.start:]...), r.buf[:r.start]...)
}
