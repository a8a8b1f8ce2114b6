package runc

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/nsdial"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/cgroups"
)

// buildAgent compiles cmd/cube-agent statically, as templates ship it.
func buildAgent(t *testing.T) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "cube-agent")
	cmd := exec.Command("go", "build", "-o", out, "github.com/cubesandbox/cube/cmd/cube-agent")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build cube-agent: %v\n%s", err, b)
	}
	return out
}

func cgroupV2Unified() bool {
	_, err := os.Stat("/sys/fs/cgroup/cgroup.controllers")
	return err == nil
}

// cgroupFile reads name from cgPath in whichever hierarchy has it.
func cgroupFile(t *testing.T, cgPath, name string) string {
	t.Helper()
	mounts, err := cgroups.Mounts()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range mounts {
		if b, err := os.ReadFile(filepath.Join(m, cgPath, name)); err == nil {
			return strings.TrimSpace(string(b))
		}
	}
	t.Fatalf("no hierarchy has %s/%s", cgPath, name)
	return ""
}

func health(ctx context.Context, c *http.Client) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://127.0.0.1:49983/health", nil)
	if err != nil {
		return err
	}
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		return fmt.Errorf("status %d", resp.StatusCode)
	}
	return nil
}

func waitHealthy(t *testing.T, c *http.Client) time.Duration {
	t.Helper()
	begin := time.Now()
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := health(ctx, c)
		cancel()
		if err == nil {
			return time.Since(begin)
		}
		if time.Since(begin) > 10*time.Second {
			t.Fatalf("agent never healthy: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestAgentSandboxLifecycle(t *testing.T) {
	requireRoot(t)
	agentBin := buildAgent(t)
	parent := cgroupParent(t)
	d := newTestDriver(t)
	dir := t.TempDir()
	id := "agent-1"
	spec := runtime.Spec{
		ID:         id,
		BundleDir:  filepath.Join(dir, "bundle"),
		RootFS:     busyboxRootFS(t, dir, map[string]string{agentBin: "usr/local/bin/cube-agent"}),
		Args:       []string{"/usr/local/bin/cube-agent"},
		CgroupPath: parent + "/" + id,
		Limits:     runtime.Limits{MilliCPU: 500, MemoryMiB: 64, Pids: 64},
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	t.Cleanup(func() { _ = d.Stop(context.Background(), id) })

	begin := time.Now()
	st, err := d.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	startTook := time.Since(begin)
	client := nsdial.HTTPClient(fmt.Sprintf("/proc/%d/ns/net", st.PID))
	t.Cleanup(client.CloseIdleConnections)
	t.Logf("timing: start=%v, agent healthy %v after start", startTook, waitHealthy(t, client))

	want := map[string]string{"pids.max": "64"}
	if cgroupV2Unified() {
		want["memory.max"] = "67108864"
		want["cpu.max"] = "50000 100000"
	} else {
		want["memory.limit_in_bytes"] = "67108864"
		want["cpu.cfs_quota_us"] = "50000"
		want["cpu.cfs_period_us"] = "100000"
	}
	for file, v := range want {
		if got := cgroupFile(t, spec.CgroupPath, file); got != v {
			t.Errorf("%s = %q, want %q", file, got, v)
		}
	}

	begin = time.Now()
	if err := d.Pause(ctx, id); err != nil {
		t.Fatal(err)
	}
	pauseTook := time.Since(begin)
	if cgroupV2Unified() {
		if got := cgroupFile(t, spec.CgroupPath, "cgroup.freeze"); got != "1" {
			t.Errorf("cgroup.freeze = %q, want 1", got)
		}
	} else if got := cgroupFile(t, spec.CgroupPath, "freezer.state"); got != "FROZEN" {
		t.Errorf("freezer.state = %q, want FROZEN", got)
	}
	client.CloseIdleConnections()
	hctx, hcancel := context.WithTimeout(ctx, 300*time.Millisecond)
	if err := health(hctx, client); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("health while paused = %v, want a timeout", err)
	}
	hcancel()

	begin = time.Now()
	if err := d.Resume(ctx, id); err != nil {
		t.Fatal(err)
	}
	resumeTook := time.Since(begin)
	client.CloseIdleConnections()
	healthyAfterResume := waitHealthy(t, client)

	begin = time.Now()
	if err := d.Stop(ctx, id); err != nil {
		t.Fatal(err)
	}
	t.Logf("timing: pause=%v resume=%v (healthy %v later) stop=%v", pauseTook, resumeTook, healthyAfterResume, time.Since(begin))
	assertSandboxGone(t, d, st, spec.CgroupPath)
}

// assertSandboxGone checks the Stop contract from the host's point of view.
func assertSandboxGone(t *testing.T, d *Driver, st runtime.State, cgPath string) {
	t.Helper()
	if _, err := d.State(context.Background(), st.ID); !errdefs.IsNotFound(err) {
		t.Errorf("State after Stop = %v, want ErrNotFound", err)
	}
	if dirs, err := cgroups.Dirs(cgPath); err != nil || len(dirs) != 0 {
		t.Errorf("cgroup dirs after Stop: %v %v", dirs, err)
	}
	if _, err := os.Stat(filepath.Join(d.rc.Root, st.ID)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("runc state dir after Stop: %v", err)
	}
	// The init may linger as a zombie until the host's init reaps it; a
	// zombie holds no resources, anything else is a leak.
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", st.PID)); err == nil {
		s := string(b)
		if fields := strings.Fields(s[strings.LastIndexByte(s, ')')+1:]); len(fields) > 0 && fields[0] != "Z" {
			t.Errorf("pid %d still alive after Stop: %s", st.PID, s)
		}
	}
}

func TestSandboxOutlivesCallerContext(t *testing.T) {
	requireRoot(t)
	parent := cgroupParent(t)
	d := newTestDriver(t)
	spec := sleepSpec(t, parent, "outlive-ctx")
	t.Cleanup(func() { _ = d.Stop(context.Background(), spec.ID) })

	ctx, cancel := context.WithCancel(context.Background())
	st, err := d.Start(ctx, spec)
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	if got, err := d.State(context.Background(), spec.ID); err != nil || got.Status != runtime.StatusRunning || got.PID != st.PID {
		t.Fatalf("after cancel: State = %+v, %v; want running pid %d", got, err, st.PID)
	}
	if err := d.Stop(context.Background(), spec.ID); err != nil {
		t.Fatal(err)
	}
	assertSandboxGone(t, d, st, spec.CgroupPath)
}

const helperEnv = "CUBE_RUNC_TEST_HELPER"

// TestHelperStartAndDie is not a test: TestSandboxOutlivesCallerProcess
// re-runs the test binary with it to start a sandbox from another process,
// which then SIGKILLs its whole process group.
func TestHelperStartAndDie(t *testing.T) {
	args := os.Getenv(helperEnv)
	if args == "" {
		t.Skip("helper for TestSandboxOutlivesCallerProcess")
	}
	var root, id, bundle, rootfs, cg string
	if _, err := fmt.Sscan(args, &root, &id, &bundle, &rootfs, &cg); err != nil {
		t.Fatal(err)
	}
	d, err := New(Config{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	st, err := d.Start(context.Background(), runtime.Spec{
		ID: id, BundleDir: bundle, RootFS: rootfs, CgroupPath: cg,
		Args: []string{"/bin/sleep", "1000000"},
	})
	if err != nil {
		t.Fatal(err)
	}
	fmt.Printf("PID=%d\n", st.PID)
	_ = unix.Kill(0, unix.SIGKILL) // our process group, as a crashing cubelet's supervisor would
	select {}
}

func TestSandboxOutlivesCallerProcess(t *testing.T) {
	requireRoot(t)
	parent := cgroupParent(t)
	d := newTestDriver(t)
	spec := sleepSpec(t, parent, "outlive-proc")
	t.Cleanup(func() { _ = d.Stop(context.Background(), spec.ID) })

	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperStartAndDie$", "-test.v")
	cmd.Env = append(os.Environ(), helperEnv+"="+strings.Join([]string{d.rc.Root, spec.ID, spec.BundleDir, spec.RootFS, spec.CgroupPath}, " "))
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	out, err := cmd.Output()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("helper: want death by SIGKILL, got %v\n%s", err, out)
	}
	_, pidStr, ok := strings.Cut(string(out), "PID=")
	if !ok {
		t.Fatalf("helper printed no PID:\n%s", out)
	}
	pid, _ := strconv.Atoi(strings.Fields(pidStr)[0])

	time.Sleep(200 * time.Millisecond)
	all, err := d.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 1 || all[0].ID != spec.ID || all[0].Status != runtime.StatusRunning || all[0].PID != pid {
		t.Fatalf("List after the starting process died = %+v, want %s running as pid %d", all, spec.ID, pid)
	}
	if err := d.Stop(context.Background(), spec.ID); err != nil {
		t.Fatal(err)
	}
	assertSandboxGone(t, d, runtime.State{ID: spec.ID, PID: pid}, spec.CgroupPath)
}

func TestFailedStartLeavesNothing(t *testing.T) {
	requireRoot(t)
	parent := cgroupParent(t)
	d := newTestDriver(t)
	spec := sleepSpec(t, parent, "bad-exec")
	spec.Args = []string{"/no/such/binary"}
	t.Cleanup(func() { _ = d.Stop(context.Background(), spec.ID) })

	_, err := d.Start(context.Background(), spec)
	if err == nil {
		t.Fatal("Start of a missing binary succeeded")
	}
	if !strings.Contains(err.Error(), "no such file") {
		t.Errorf("error does not carry runc's reason: %v", err)
	}
	assertSandboxGone(t, d, runtime.State{ID: spec.ID, PID: -1}, spec.CgroupPath)
	if all, err := d.List(context.Background()); err != nil || len(all) != 0 {
		t.Errorf("List after failed start = %+v, %v", all, err)
	}
}
