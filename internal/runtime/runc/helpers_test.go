package runc

import (
	"crypto/rand"
	"encoding/hex"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/cgroups"
	"github.com/cubesandbox/cube/internal/testenv"
)

func requireRoot(t *testing.T) {
	t.Helper()
	testenv.RequireRoot(t, "runc creates namespaces and cgroups")
	if _, err := os.Stat("/bin/busybox"); err != nil {
		testenv.Missing(t, "needs /bin/busybox (busybox-static) for the test rootfs")
	}
}

// namedNetNS adds a network namespace bound under /run/netns (as `ip
// netns add` makes them), deleted when the test ends, and returns its name.
func namedNetNS(tb testing.TB, prefix string) string {
	tb.Helper()
	testenv.RequireBinary(tb, "ip", "iproute2")
	name := prefix + strconv.Itoa(os.Getpid())
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		tb.Fatalf("ip netns add: %v: %s", err, out)
	}
	tb.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() })
	return name
}

type tWriter struct{ t *testing.T }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// newTestDriver gives each test its own runc root, so parallel packages and
// earlier crashed runs cannot collide with it.
func newTestDriver(t *testing.T) *Driver {
	t.Helper()
	return newTestDriverWith(t, UserNS{})
}

// newTestDriverWith is newTestDriver with the given user namespace
// settings. Its root lies in a directory other users may pass through
// (t.TempDir's parent is 0700), as the sandboxes' idmapped root
// filesystems next to it must be reachable by their ranges' roots.
func newTestDriverWith(t *testing.T, u UserNS) *Driver {
	t.Helper()
	d, err := New(Config{Root: filepath.Join(searchableDir(t), "runc"), Logger: testLogger(t), UserNS: u})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// searchableDir returns a fresh directory under os.TempDir() with mode
// 0711, removed when t ends.
func searchableDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "cube-runc-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o711); err != nil {
		t.Fatal(err)
	}
	return dir
}

// cgroupParent returns a cgroup parent unique to t and removes it from every
// hierarchy when t ends (after the sandboxes in it were stopped).
func cgroupParent(t *testing.T) string {
	t.Helper()
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	parent := "/cube-test-" + hex.EncodeToString(b)
	t.Cleanup(func() {
		if _, err := cgroups.Remove(parent, 2*time.Second); err != nil {
			t.Errorf("remove test cgroup parent: %v", err)
		}
	})
	return parent
}

// busyboxRootFS builds a minimal rootfs: busybox plus the applets the tests
// use, and an optional extra binary installed at dst.
func busyboxRootFS(t *testing.T, dir string, extra map[string]string) string {
	t.Helper()
	root := filepath.Join(dir, "rootfs")
	for _, d := range []string{"bin", "proc", "sys", "dev", "tmp", "etc", "usr/local/bin"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	copyFile(t, "/bin/busybox", filepath.Join(root, "bin/busybox"))
	for _, applet := range []string{"sh", "sleep", "cat", "ls", "ps", "wget"} {
		if err := os.Symlink("busybox", filepath.Join(root, "bin", applet)); err != nil {
			t.Fatal(err)
		}
	}
	for src, dst := range extra {
		copyFile(t, src, filepath.Join(root, dst))
	}
	return root
}

func copyFile(t *testing.T, src, dst string) {
	t.Helper()
	in, err := os.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
}

// sleepSpec returns a Spec running busybox sleep as PID 1 in its own
// bundle, rootfs and cgroup under parent.
func sleepSpec(t *testing.T, parent, id string) runtime.Spec {
	dir := t.TempDir()
	return runtime.Spec{
		ID:         id,
		BundleDir:  filepath.Join(dir, "bundle"),
		RootFS:     busyboxRootFS(t, dir, nil),
		Args:       []string{"/bin/sleep", "1000000"},
		Env:        []string{"PATH=/usr/local/bin:/usr/bin:/bin"},
		CgroupPath: parent + "/" + id,
		Limits:     runtime.Limits{MilliCPU: 250, MemoryMiB: 32, Pids: 32},
	}
}

func assertNoChildCgroups(t *testing.T, parent string) {
	t.Helper()
	dirs, err := cgroups.Dirs(parent)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range dirs {
		ents, err := os.ReadDir(d)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ents {
			if e.IsDir() {
				t.Errorf("cgroup %s left behind", filepath.Join(d, e.Name()))
			}
		}
	}
}
