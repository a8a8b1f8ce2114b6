package usage

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cubesandbox/cube/internal/runtime/cgroups"
	"github.com/cubesandbox/cube/internal/testenv"
)

// cgroupRoot makes a fresh parent cgroup in one writable hierarchy and
// returns its path (relative to the hierarchies) and directory; both go
// at cleanup with whatever the test left under them.
func cgroupRoot(t *testing.T) (path, dir string) {
	t.Helper()
	testenv.RequireRoot(t, "creates cgroups")
	mounts, err := cgroups.Mounts()
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	path = "/cube-usagetest-" + hex.EncodeToString(b)
	for _, m := range mounts {
		d := filepath.Join(m, path)
		if err := os.Mkdir(d, 0o755); err == nil {
			t.Cleanup(func() {
				subs, _ := os.ReadDir(d)
				for _, s := range subs {
					if s.IsDir() {
						_ = os.Remove(filepath.Join(d, s.Name()))
					}
				}
				_ = os.Remove(d)
			})
			return path, d
		}
	}
	testenv.Missing(t, "no writable cgroup hierarchy")
	return "", ""
}

// targets is a mutable target list for a sampler.
type targets struct {
	mu sync.Mutex
	ts []Target
}

func (l *targets) get() []Target {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.ts)
}

func (l *targets) set(ts []Target) {
	l.mu.Lock()
	l.ts = ts
	l.mu.Unlock()
}

func seriesCount(t *testing.T, reg *prometheus.Registry) int {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, mf := range mfs {
		n += len(mf.GetMetric())
	}
	return n
}

// TestCardinalityBound creates and destroys 1,000 sandboxes' cgroups
// (real cgroups; the cheapest thing the sampler reads that a sandbox
// has) in batches of 100 with a tick after each step: while a batch
// lives, the registry has its series; once it is gone, the registry is
// back at its baseline. A control step shows that a sandbox the sampler
// still lists keeps its series, so the drop is the sampler's doing.
func TestCardinalityBound(t *testing.T) {
	parent, dir := cgroupRoot(t)
	var l targets
	s := New(Config{Interval: time.Second, Keep: 4, Series: true}, l.get, nil)
	reg := prometheus.NewRegistry()
	reg.MustRegister(s.Collector())
	base := seriesCount(t, reg)
	const total, batch, perSandbox = 1000, 100, 9
	for b := 0; b < total/batch; b++ {
		var ts []Target
		for i := 0; i < batch; i++ {
			name := fmt.Sprintf("sb-%04d", b*batch+i)
			if err := os.Mkdir(filepath.Join(dir, name), 0o755); err != nil {
				t.Fatal(err)
			}
			ts = append(ts, Target{ID: name, CgroupPath: parent + "/" + name, Live: true})
		}
		l.set(ts)
		tick := time.Now()
		s.Tick()
		if b == 0 {
			t.Logf("a tick over %d sandboxes took %s", batch, time.Since(tick).Round(time.Microsecond))
		}
		if got, want := seriesCount(t, reg), base+batch*perSandbox; got != want {
			t.Fatalf("batch %d alive: %d series, want %d", b, got, want)
		}
		// Control: the last sandbox is still listed (paused, say) while
		// the others are destroyed; it keeps its series.
		for _, tg := range ts[:batch-1] {
			if err := os.Remove(filepath.Join(dir, tg.ID)); err != nil {
				t.Fatal(err)
			}
		}
		keep := ts[batch-1]
		keep.Live = false
		l.set([]Target{keep})
		s.Tick()
		if got, want := seriesCount(t, reg), base+perSandbox; got != want {
			t.Fatalf("batch %d, one left listed: %d series, want %d", b, got, want)
		}
		if err := os.Remove(filepath.Join(dir, keep.ID)); err != nil {
			t.Fatal(err)
		}
		if b%2 == 0 {
			l.set(nil)
			s.Tick()
		} else {
			s.Forget(keep.ID) // the core's path when a record goes
			l.set(nil)
		}
		if got := seriesCount(t, reg); got != base {
			t.Fatalf("batch %d destroyed: %d series, want the baseline %d", b, got, base)
		}
	}
	if n := len(s.Latest()); n != 0 {
		t.Errorf("%d rings left after %d sandboxes came and went", n, total)
	}
	t.Logf("%d sandboxes created and destroyed; series back at baseline %d", total, base)
}

// TestHistory checks the ring: bounded to Keep, oldest first, filtered by
// time, and read from a real cgroup, a real filesystem, a real image and
// a real link (loopback, with traffic sent between two ticks).
func TestHistory(t *testing.T) {
	parent, dir := cgroupRoot(t)
	if err := os.Mkdir(filepath.Join(dir, "sb"), 0o755); err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(t.TempDir(), "disk.img")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(64 << 20); err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(make([]byte, 1<<20), 0); err != nil {
		t.Fatal(err)
	}
	_ = f.Sync()
	f.Close()
	tg := Target{ID: "sb", CgroupPath: parent + "/sb", MilliCPU: 1500, Image: img, HostLink: "lo", Live: true}
	var l targets
	l.set([]Target{tg})
	s := New(Config{Interval: time.Second, Keep: 3}, l.get, nil)

	var stamps []time.Time
	for i := 0; i < 5; i++ {
		if i == 4 {
			sendLoopback(t, 1<<20)
		}
		s.Tick()
		h := s.History("sb", time.Time{}, time.Time{})
		stamps = append(stamps, h[len(h)-1].At)
		time.Sleep(5 * time.Millisecond)
	}
	h := s.History("sb", time.Time{}, time.Time{})
	if len(h) != 3 {
		t.Fatalf("history holds %d samples, want Keep=3", len(h))
	}
	if !h[0].At.Equal(stamps[2]) || !h[2].At.Equal(stamps[4]) {
		t.Errorf("history %v..%v, want the last three ticks %v..%v", h[0].At, h[2].At, stamps[2], stamps[4])
	}
	if got := s.History("sb", stamps[3], time.Time{}); len(got) != 2 {
		t.Errorf("history from the 4th tick: %d samples, want 2", len(got))
	}
	if got := s.History("sb", time.Time{}, stamps[2]); len(got) != 1 {
		t.Errorf("history to the 3rd tick: %d samples, want 1", len(got))
	}
	last := h[2]
	t.Logf("last sample: %+v", last)
	if last.CPUCount != 2 {
		t.Errorf("CPU count %d, want 2 (1500 milli-CPU rounded up)", last.CPUCount)
	}
	if last.DiskTotal != 64<<20 || last.DiskUsed < 1<<20 || last.DiskUsed > 2<<20 {
		t.Errorf("disk %d of %d, want about 1 MiB of 64 MiB", last.DiskUsed, last.DiskTotal)
	}
	// lo counts each byte as sent and received.
	if d := last.NetRx - h[1].NetRx; d < 1<<20 {
		t.Errorf("received %d bytes between the last two ticks, want >= the 1 MiB sent", d)
	}
	if last.NetTx == 0 {
		t.Error("no transmitted bytes read")
	}
	s.Forget("sb")
	if s.History("sb", time.Time{}, time.Time{}) != nil {
		t.Error("history kept after Forget")
	}
}

func sendLoopback(t *testing.T, n int) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		buf := make([]byte, 64<<10)
		for {
			if _, err := c.Read(buf); err != nil {
				c.Close()
				return
			}
		}
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write(make([]byte, n)); err != nil {
		t.Fatal(err)
	}
	c.Close()
	<-done
}

// TestHistoryMaxBytes checks the shared bound: with more sandboxes than
// MaxBytes holds Keep samples of, each ring keeps its newest samples
// only, never allocating past its bound; when sandboxes leave, the
// survivors grow back towards Keep.
func TestHistoryMaxBytes(t *testing.T) {
	parent, dir := cgroupRoot(t)
	var ts []Target
	for i := range 4 {
		id := fmt.Sprintf("sb%d", i)
		if err := os.Mkdir(filepath.Join(dir, id), 0o755); err != nil {
			t.Fatal(err)
		}
		ts = append(ts, Target{ID: id, CgroupPath: parent + "/" + id, MilliCPU: 1000, Live: true})
	}
	var l targets
	l.set(ts)
	// Room for 4 rings of 3 samples: each keeps 3 of Keep=10.
	s := New(Config{Interval: time.Second, Keep: 10, MaxBytes: 4 * 3 * SampleBytes}, l.get, nil)
	for range 7 {
		s.Tick()
		time.Sleep(2 * time.Millisecond)
	}
	held := func(id string) (int, int) {
		s.mu.Lock()
		defer s.mu.Unlock()
		r := s.rings[id]
		return len(r.buf), cap(r.buf)
	}
	for _, tg := range ts {
		h := s.History(tg.ID, time.Time{}, time.Time{})
		if n, c := held(tg.ID); len(h) != 3 || c > 3 {
			t.Fatalf("%s holds %d samples (%d allocated), want 3 of Keep=10 under MaxBytes", tg.ID, n, c)
		}
		if !slices.IsSortedFunc(h, func(a, b Sample) int { return a.At.Compare(b.At) }) {
			t.Errorf("%s: samples out of order: %v", tg.ID, h)
		}
	}
	if got := s.History("sb0", time.Time{}, time.Time{}); !got[2].At.After(got[0].At) {
		t.Errorf("sb0 kept %v, want its newest samples", got)
	}
	// Three leave: the one left may keep 12 samples' worth, capped at Keep.
	l.set(ts[:1])
	for range 12 {
		s.Tick()
		time.Sleep(2 * time.Millisecond)
	}
	h := s.History("sb0", time.Time{}, time.Time{})
	if n, c := held("sb0"); len(h) != 10 || c > 10 {
		t.Fatalf("sb0 alone holds %d samples (%d allocated), want Keep=10", n, c)
	}
	if !slices.IsSortedFunc(h, func(a, b Sample) int { return a.At.Compare(b.At) }) {
		t.Errorf("samples out of order after growing back: %v", h)
	}
	t.Logf("4 sandboxes: 3 samples each; 1 sandbox: %d samples; sample = %d bytes", len(h), SampleBytes)
}
