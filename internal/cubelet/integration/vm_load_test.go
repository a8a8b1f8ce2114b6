package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/testenv"
	"github.com/cubesandbox/cube/internal/vmguest"
)

// TestVMConcurrentCreates: VM sandboxes created at once under TCG all
// boot although sandbox.agent_ready_timeout is far below a TCG boot: the
// agent wait scales with the accelerator and with the boots in flight per
// CPU (docs/timeouts.md). Three at once here; CUBE_VM_LOAD=8 runs eight
// (slow: minutes on two CPUs).
func TestVMConcurrentCreates(t *testing.T) {
	cubelettest.RequireRoot(t)
	testenv.RequireBinary(t, "qemu-system-x86_64", "qemu-system-x86")
	n := 3
	if v, err := strconv.Atoi(os.Getenv("CUBE_VM_LOAD")); err == nil && v > 0 {
		n = v
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	dir := filepath.Join(vmguest.DefaultCacheDir, "guest-cubelet")
	if _, err := vmguest.Build(ctx, vmguest.BuildConfig{OutDir: dir}); err != nil {
		t.Fatalf("guest artifacts: %v", err)
	}
	// A base below the default 20 s, so that the scaling is what lets
	// the boots finish: three TCG boots at once take 10-35 s on a shared
	// two-core machine; scaled, the wait is 5 s × 6 × 3/2 = 45 s there.
	env := cubelettest.New(t, fmt.Sprintf("[vm]\nguest_dir = %q\naccel = \"tcg\"\n[sandbox]\nagent_ready_timeout = \"5s\"\n", dir))
	env.StartNetworkAgent(t, nettest.Options{PoolSize: 1})
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	t.Cleanup(func() {
		for _, sb := range mustList(t, svc) {
			if _, err := svc.Delete(context.Background(), sb.ID); err != nil {
				t.Error(err)
			}
		}
		env.AssertNoLeaks(t)
	})

	var wg sync.WaitGroup
	errs := make([]error, n)
	took := make([]time.Duration, n)
	begin := time.Now()
	for i := range n {
		wg.Go(func() {
			start := time.Now()
			_, errs[i] = svc.Create(context.Background(), cubelet.CreateRequest{
				SandboxID: fmt.Sprintf("vmload-%d", i), TemplateID: "busybox", Runtime: "vm",
			})
			took[i] = time.Since(start)
		})
	}
	wg.Wait()
	for i := range n {
		t.Logf("VM %d: create-to-ready %s, err %v", i, took[i].Round(time.Millisecond), errs[i])
	}
	t.Logf("%d TCG VMs at once: all done in %s", n, time.Since(begin).Round(time.Millisecond))
	for i, err := range errs {
		if err != nil {
			t.Errorf("VM %d: %v", i, err)
		}
	}
}
