package gvisor

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/cgroups"
	"github.com/cubesandbox/cube/internal/testenv"
)

func requireRunsc(t *testing.T) {
	t.Helper()
	testenv.RequireRoot(t, "runsc creates namespaces and cgroups")
	testenv.RequireBinary(t, "runsc", "runsc")
	if _, err := os.Stat("/bin/busybox"); err != nil {
		testenv.Missing(t, "needs /bin/busybox (busybox-static) for the test rootfs")
	}
}

type tWriter struct{ t *testing.T }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// newTestDriver gives each test its own runsc root and checks, when the
// test ends, that the root is empty and no runsc process of it is left.
func newTestDriver(t *testing.T) *Driver {
	t.Helper()
	root := t.TempDir()
	d, err := New(Config{Root: root, Checkpoint: true, Debug: os.Getenv("CUBE_GVISOR_DEBUG") != "", Logger: slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { assertNoRunscLeft(t, d, root) })
	return d
}

// assertNoRunscLeft runs after every sandbox of a test was stopped.
func assertNoRunscLeft(t *testing.T, d *Driver, root string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if all, err := d.List(ctx); err != nil || len(all) != 0 {
		t.Errorf("after cleanup, List = %+v, %v; want empty", all, err)
	}
	if pids := runscProcs(root); len(pids) > 0 {
		t.Errorf("runsc processes of root %s left: %v", root, pids)
	}
	// No state or lock file either: runsc's own delete removes both, a
	// lock file left is one a racing runsc verb created again.
	if ents, _ := os.ReadDir(root); len(ents) > 0 {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Errorf("runsc root %s not empty after cleanup: %v", root, names)
	}
}

// runscProcs lists processes whose command line names root (the sandbox
// and gofer processes carry --root=<root>).
func runscProcs(root string) []string {
	ents, _ := os.ReadDir("/proc")
	var out []string
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		cmd := strings.ReplaceAll(string(b), "\x00", " ")
		if strings.Contains(cmd, "--root="+root+" ") || strings.Contains(cmd, "--root "+root+" ") {
			out = append(out, e.Name()+": "+cmd)
		}
	}
	return out
}

// cgroupParent returns a parent unique to t, removed when t ends.
func cgroupParent(t *testing.T) string {
	t.Helper()
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	parent := "/cube-gtest-" + hex.EncodeToString(b)
	t.Cleanup(func() {
		dirs, _ := cgroups.Dirs(parent)
		for _, d := range dirs {
			ents, _ := os.ReadDir(d)
			for _, e := range ents {
				if e.IsDir() {
					t.Errorf("cgroup %s left behind", filepath.Join(d, e.Name()))
				}
			}
		}
		if _, err := cgroups.Remove(parent, 2*time.Second); err != nil {
			t.Errorf("remove test cgroup parent: %v", err)
		}
	})
	return parent
}

func busyboxRootFS(t *testing.T, dir string) string {
	t.Helper()
	root := filepath.Join(dir, "rootfs")
	for _, d := range []string{"bin", "proc", "sys", "dev", "tmp", "etc"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	in, err := os.Open("/bin/busybox")
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.OpenFile(filepath.Join(root, "bin/busybox"), os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
	for _, applet := range []string{"sh", "sleep", "cat", "echo"} {
		if err := os.Symlink("busybox", filepath.Join(root, "bin", applet)); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

// shellSpec runs script with busybox sh as PID 1.
func shellSpec(t *testing.T, parent, id, script string) runtime.Spec {
	dir := t.TempDir()
	if keep := os.Getenv("CUBE_GVISOR_DEBUG"); keep != "" {
		// Keep the bundle (runsc debug logs) of a failed test.
		t.Cleanup(func() {
			if t.Failed() {
				_ = exec.Command("cp", "-a", filepath.Join(dir, "bundle"), filepath.Join(keep, t.Name()+"-"+id)).Run()
			}
		})
	}
	return runtime.Spec{
		ID:         id,
		BundleDir:  filepath.Join(dir, "bundle"),
		RootFS:     busyboxRootFS(t, dir),
		Args:       []string{"/bin/sh", "-c", script},
		Env:        []string{"PATH=/bin"},
		CgroupPath: parent + "/" + id,
		Limits:     runtime.Limits{MilliCPU: 500, MemoryMiB: 256, Pids: 1024},
	}
}
