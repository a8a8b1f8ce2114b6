package vm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/agent/agenttest"
	"github.com/cubesandbox/cube/internal/agentchan"
	"github.com/cubesandbox/cube/internal/leakcheck"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/cgroups"
	"github.com/cubesandbox/cube/internal/testenv"
	"github.com/cubesandbox/cube/internal/vmguest"
)

// testGuestDir holds the guest artifacts the tests boot, built once and
// kept between runs (vmguest.Build is a no-op when they are current).
var testGuestDir = filepath.Join(vmguest.DefaultCacheDir, "guest-vmdriver")

// testAccel is the accelerator the tests use: CUBE_VM_ACCEL, else tcg.
// (On the CI hosts /dev/kvm accepts KVM_CREATE_VM but the guest kernel
// hangs right after decompression; docs/vm.md, Troubleshooting.)
func testAccel() string {
	if a := os.Getenv("CUBE_VM_ACCEL"); a != "" {
		return a
	}
	return "tcg"
}

func requireVM(t testing.TB) {
	t.Helper()
	testenv.RequireRoot(t, "cgroups, netns")
	for tool, pkg := range map[string]string{"qemu-system-x86_64": "qemu-system-x86", "zstd": "zstd", "mkfs.ext4": "e2fsprogs", "nsenter": "util-linux"} {
		testenv.RequireBinary(t, tool, pkg)
	}
	if _, err := os.Stat(vmguest.DefaultBusybox); err != nil {
		testenv.Missing(t, "needs busybox-static")
	}
}

var (
	guestOnce sync.Once
	guestErr  error
	imageOnce sync.Once
	imagePath string
	imageErr  error
)

func guestDir(t testing.TB) string {
	t.Helper()
	guestOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		_, guestErr = vmguest.Build(ctx, vmguest.BuildConfig{OutDir: testGuestDir, CacheDir: vmguest.DefaultCacheDir})
	})
	if guestErr != nil {
		t.Fatalf("build guest: %v", guestErr)
	}
	return testGuestDir
}

type tWriter struct{ t testing.TB }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// testEnv is one test's driver with its own root, bundles and cgroup
// parent; at cleanup it checks nothing of it is left.
type testEnv struct {
	d      *Driver
	dir    string // RunDir of the leak scope; bundles under dir/b
	cgroup string // cgroup parent, e.g. /cube-vmtest-1a2b3c4d
}

func newEnv(t testing.TB, extra ...string) *testEnv {
	t.Helper()
	requireVM(t)
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	// Short: QEMU's sockets must fit in sun_path.
	dir, err := os.MkdirTemp("", "vmt")
	if err != nil {
		t.Fatal(err)
	}
	// CUBE_VM_CMDLINE adds kernel parameters, e.g. "loglevel=7" to see a
	// failing boot in the console log the failure quotes.
	extra = append(extra, strings.Fields(os.Getenv("CUBE_VM_CMDLINE"))...)
	e := &testEnv{dir: dir, cgroup: "/cube-vmtest-" + hex.EncodeToString(b)}
	d, err := New(Config{
		GuestDir: guestDir(t), Accel: testAccel(), Root: filepath.Join(dir, "root"), ExtraCmdline: extra,
		Logger: slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug})),
	})
	if err != nil {
		t.Fatal(err)
	}
	e.d = d
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if all, err := d.List(ctx); err != nil || len(all) != 0 {
			t.Errorf("after the test, List = %+v, %v; want empty", all, err)
			for _, s := range all {
				_ = d.Stop(ctx, s.ID)
			}
		}
		leakcheck.AssertNone(t, ctx, leakcheck.Scope{RunDir: dir, CgroupName: strings.TrimPrefix(e.cgroup, "/"), VMRoot: d.root})
		// uids are allocated outside Root (shared by the host's drivers).
		uids, _ := filepath.Glob(filepath.Join(d.uids.dir, "*"))
		for _, f := range uids {
			if b, _ := os.ReadFile(f); strings.HasPrefix(string(b), d.root+"/") {
				t.Errorf("leak: vm uid %s still allocated to %s", filepath.Base(f), b)
			}
		}
		if _, err := cgroups.Remove(e.cgroup, 2*time.Second); err != nil {
			t.Errorf("remove cgroup parent: %v", err)
		}
		_ = os.RemoveAll(dir)
	})
	return e
}

// spec makes a bundle and a reflink/copy of the root image for id.
func (e *testEnv) spec(t testing.TB, id string) runtime.Spec {
	t.Helper()
	bundle := filepath.Join(e.dir, "b", id)
	if err := os.MkdirAll(bundle, 0o700); err != nil {
		t.Fatal(err)
	}
	disk := filepath.Join(bundle, "disk.ext4")
	copyFile(t, rootImage(t), disk)
	return runtime.Spec{
		ID: id, BundleDir: bundle, Disk: disk, Hostname: id,
		CgroupPath: e.cgroup + "/" + id, Limits: runtime.Limits{MilliCPU: 1000, MemoryMiB: 256},
	}
}

func copyFile(t testing.TB, from, to string) {
	t.Helper()
	if out, err := exec.Command("cp", "--reflink=auto", "--sparse=always", from, to).CombinedOutput(); err != nil {
		t.Fatalf("cp %s: %v: %s", from, err, out)
	}
}

// rootImage is a 64 MiB ext4 root with busybox and a static cube-agent,
// built once per test binary.
func rootImage(t testing.TB) string {
	t.Helper()
	imageOnce.Do(func() { imagePath, imageErr = buildRootImage() })
	if imageErr != nil {
		t.Fatalf("root image: %v", imageErr)
	}
	return imagePath
}

func buildRootImage() (string, error) {
	dir, err := os.MkdirTemp("", "cube-vm-image")
	if err != nil {
		return "", err
	}
	root := filepath.Join(dir, "rootfs")
	for _, d := range []string{"bin", "etc", "root", "usr/local/bin", "proc", "sys", "dev", "run", "tmp"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			return "", err
		}
	}
	bb, err := os.ReadFile(vmguest.DefaultBusybox)
	if err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(root, "bin/busybox"), bb, 0o755); err != nil {
		return "", err
	}
	for _, a := range []string{"sh", "cat", "echo", "hostname", "sleep", "setsid", "tr", "grep", "head", "sync", "id"} {
		if err := os.Symlink("busybox", filepath.Join(root, "bin", a)); err != nil {
			return "", err
		}
	}
	_ = os.WriteFile(filepath.Join(root, "etc/passwd"), []byte("root:x:0:0:root:/root:/bin/sh\n"), 0o644)
	_ = os.WriteFile(filepath.Join(root, "etc/group"), []byte("root:x:0:\n"), 0o644)
	build := exec.Command("go", "build", "-o", filepath.Join(root, "usr/local/bin/cube-agent"), "github.com/cubesandbox/cube/cmd/cube-agent")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build cube-agent: %v: %s", err, out)
	}
	img := filepath.Join(dir, "root.ext4")
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-d", root, img, "64M").CombinedOutput(); err != nil {
		return "", fmt.Errorf("mkfs.ext4: %v: %s", err, out)
	}
	return img, os.RemoveAll(root)
}

func TestMain(m *testing.M) {
	code := m.Run()
	if imagePath != "" {
		_ = os.RemoveAll(filepath.Dir(imagePath))
	}
	os.Exit(code)
}

// stopAtEnd stops id when the test ends, whatever happened.
func stopAtEnd(t testing.TB, d *Driver, id string) {
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := d.Stop(ctx, id); err != nil {
			t.Errorf("cleanup: Stop(%s): %v", id, err)
		}
	})
}

// agentClient waits for id's agent to answer /health over the channel.
func agentClient(ctx context.Context, t testing.TB, d *Driver, id string, limit time.Duration) *http.Client {
	t.Helper()
	sock, err := d.AgentSocket(id)
	if err != nil {
		t.Fatal(err)
	}
	c := agentchan.SerialClient(sock)
	err = agenttest.WaitHealthy(ctx, c, agentchan.BaseURL, limit)
	if err == nil {
		return c
	}
	con, _ := d.ConsoleLog(id)
	b, _ := os.ReadFile(con)
	t.Fatalf("agent of %s: %v\nconsole:\n%s", id, err, b)
	return nil
}

// run runs a shell script in the guest through the agent's process API.
func run(ctx context.Context, t testing.TB, c *http.Client, script string) string {
	t.Helper()
	return agenttest.Shell(ctx, t, c, agentchan.BaseURL, script)
}

// wantNoFiles checks what Stop must remove from a bundle.
func wantNoFiles(t testing.TB, bundle string) {
	t.Helper()
	for _, f := range []string{"qmp.sock", "agent.sock", "qemu.pid"} {
		if _, err := os.Stat(filepath.Join(bundle, f)); err == nil {
			t.Errorf("%s left in %s", f, bundle)
		}
	}
}

// inCgroup checks pid is a member of path in every hierarchy.
func inCgroup(path string, pid int) error {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return err
	}
	var errs []error
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		// hierarchy-ID:controllers:path
		parts := strings.SplitN(line, ":", 3)
		if len(parts) == 3 && parts[2] != path {
			errs = append(errs, fmt.Errorf("pid %d in %q, want %q (%s)", pid, parts[2], path, line))
		}
	}
	return errors.Join(errs...)
}
