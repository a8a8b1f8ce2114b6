package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/runtime/cgroups"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// TestMeasurePoolBurst prints what docs/pools.md reports of a burst of
// claims: wall times, and the CPU the claims cost, cubelet's (this
// process) and the claimed sandboxes' (their cgroups, since they were
// frozen: the agents' wake-up and reinit), per claim. It only runs with CUBE_POOL_MEASURE=<burst>.
func TestMeasurePoolBurst(t *testing.T) {
	n := 0
	if _, err := fmt.Sscan(os.Getenv("CUBE_POOL_MEASURE"), &n); err != nil || n <= 0 {
		t.Skip("set CUBE_POOL_MEASURE=<burst size> to measure")
	}
	toml := fmt.Sprintf("\n[warm_pool]\nmax = %d\nrefill_interval = \"0s\"\n[warm_pool.templates]\nbusybox = %d\n", n, n)
	env := cubelettest.New(t, toml)
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()
	for round := range 3 {
		waitPool(t, svc, "busybox", n)
		time.Sleep(500 * time.Millisecond) // the last refill's freeze settles
		frozenCPU := map[string]time.Duration{}
		for _, id := range poolContainers(t, env) {
			frozenCPU[id] = cgroupCPU(t, &sandbox.Record{Container: &sandbox.Container{CgroupPath: env.Config.Node.CgroupParent + "/" + id}})
		}
		var prof *os.File
		if path := os.Getenv("CUBE_POOL_MEASURE_PROFILE"); path != "" && round == 2 {
			f, err := os.Create(path)
			if err != nil {
				t.Fatal(err)
			}
			runtime.SetCPUProfileRate(2000) // claims are short: 100 Hz sees a few samples
			if err := pprof.StartCPUProfile(f); err != nil {
				t.Fatal(err)
			}
			prof = f
		}
		var before syscall.Rusage
		_ = syscall.Getrusage(syscall.RUSAGE_SELF, &before)
		res := make([]*cubelet.Result, n)
		lat := make([]time.Duration, n)
		var wg sync.WaitGroup
		begin := time.Now()
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				b := time.Now()
				r, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox", SandboxID: fmt.Sprintf("burst-%d-%d", round, i)})
				lat[i] = time.Since(b)
				if err != nil || !r.Pooled {
					t.Errorf("create %d: pooled %v, %v", i, r != nil && r.Pooled, err)
					return
				}
				res[i] = r
			}()
		}
		wg.Wait()
		wall := time.Since(begin)
		if prof != nil {
			pprof.StopCPUProfile()
			prof.Close()
		}
		var after syscall.Rusage
		_ = syscall.Getrusage(syscall.RUSAGE_SELF, &after)
		cpu := func(r syscall.Rusage) time.Duration {
			return time.Duration(r.Utime.Nano() + r.Stime.Nano())
		}
		var agents time.Duration
		for _, r := range res {
			if r != nil {
				agents += cgroupCPU(t, r.Sandbox) - frozenCPU[r.Sandbox.HostKey()]
			}
		}
		sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
		t.Logf("burst of %d: wall %v, p50 %v, max %v; cubelet CPU %v (%v per claim); claimed sandboxes' CPU %v (%v per claim)",
			n, wall.Round(time.Millisecond), lat[n/2].Round(100*time.Microsecond), lat[n-1].Round(100*time.Microsecond),
			(cpu(after) - cpu(before)).Round(time.Millisecond), ((cpu(after) - cpu(before)) / time.Duration(n)).Round(10*time.Microsecond),
			agents.Round(time.Millisecond), (agents / time.Duration(n)).Round(10*time.Microsecond))
		for _, r := range res {
			if r != nil {
				if _, err := svc.Delete(ctx, r.Sandbox.ID); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
}

// cgroupCPU is the CPU time the sandbox's cgroup has used (cgroup v1
// cpuacct, else v2 cpu.stat).
func cgroupCPU(t *testing.T, sb *sandbox.Record) time.Duration {
	t.Helper()
	dirs, err := cgroups.Dirs(sb.Container.CgroupPath)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range dirs {
		if b, err := os.ReadFile(filepath.Join(d, "cpuacct.usage")); err == nil {
			ns, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
			return time.Duration(ns)
		}
	}
	for _, d := range dirs {
		b, _ := os.ReadFile(filepath.Join(d, "cpu.stat"))
		for _, l := range strings.Split(string(b), "\n") {
			if f := strings.Fields(l); len(f) == 2 && f[0] == "usage_usec" {
				us, _ := strconv.ParseInt(f[1], 10, 64)
				return time.Duration(us) * time.Microsecond
			}
		}
	}
	t.Fatalf("no CPU usage under %v", dirs)
	return 0
}
