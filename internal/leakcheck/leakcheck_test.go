package leakcheck

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/loopdev"
	"github.com/cubesandbox/cube/internal/testenv"
)

func requireRoot(t *testing.T) {
	t.Helper()
	testenv.RequireRoot(t, "mounts, loop devices, cgroups")
}

func mkdir(t *testing.T, p string) {
	t.Helper()
	if err := os.MkdirAll(p, 0o755); err != nil {
		t.Fatal(err)
	}
}

func mountTmpfs(t *testing.T, target string) {
	t.Helper()
	mkdir(t, target)
	if err := unix.Mount("tmpfs", target, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(target, unix.MNT_DETACH) })
}

func attach(t *testing.T, file string) string {
	t.Helper()
	mkdir(t, filepath.Dir(file))
	if err := os.WriteFile(file, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	dev, err := loopdev.Attach(context.Background(), file, true)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = loopdev.Detach(dev) })
	return dev
}

func startProcess(t *testing.T, cmd *exec.Cmd) {
	t.Helper()
	// Own process group, so killing it also kills sh's sleep child.
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Setpgid = true
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stop(cmd) })
}

func stop(cmd *exec.Cmd) {
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	_ = cmd.Wait()
}

// TestCheckFindsEveryKind makes one real leak of each kind, checks each is
// reported and the allowed ones are not, then removes them and expects a
// clean report.
func TestCheckFindsEveryKind(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	base := t.TempDir()
	s := Scope{
		DataDir:    filepath.Join(base, "data"),
		RunDir:     filepath.Join(base, "run"),
		RuncRoot:   filepath.Join(base, "run", "runc"),
		CgroupName: fmt.Sprintf("cube-leakcheck-%d", os.Getpid()),
	}
	s.AllowMounts = []string{filepath.Join(s.DataDir, "pool")}
	s.AllowLoopBacking = []string{filepath.Join(s.DataDir, "pool.img")}
	mkdir(t, s.DataDir)
	mkdir(t, s.RunDir)

	AssertNone(t, ctx, s)

	// Allowed: the pool mount and pool image.
	mountTmpfs(t, filepath.Join(s.DataDir, "pool"))
	attach(t, filepath.Join(s.DataDir, "pool.img"))

	// Leaks.
	rootfs := filepath.Join(s.RunDir, "sandboxes", "sb1", "rootfs")
	mountTmpfs(t, rootfs)
	disk := filepath.Join(s.DataDir, "pool", "sandboxes", "sb1", "disk.img")
	dev := attach(t, disk)
	mkdir(t, filepath.Join(s.RuncRoot, "sb1"))

	var cgroups []string
	mounts, err := mountinfo.GetMounts(mountinfo.FSTypeFilter("cgroup", "cgroup2"))
	if err != nil {
		t.Fatal(err)
	}
	for _, parent := range cgroupParents(mounts, s.CgroupName) {
		child := filepath.Join(parent, "sb1")
		if err := os.MkdirAll(child, 0o755); err != nil {
			t.Logf("skipping cgroup hierarchy %s: %v", parent, err)
			continue
		}
		cgroups = append(cgroups, child)
		t.Cleanup(func() {
			_ = os.Remove(child)
			_ = os.Remove(parent)
		})
	}

	// A process "inside" a sandbox root, and one naming a sandbox dir.
	chroot := filepath.Join(s.DataDir, "chroot")
	mkdir(t, chroot)
	copyFile(t, "/bin/busybox", filepath.Join(chroot, "busybox"))
	jailed := exec.Command("/busybox", "sleep", "60")
	jailed.SysProcAttr = &syscall.SysProcAttr{Chroot: chroot}
	startProcess(t, jailed)
	// The trailing ": path" keeps sh from exec'ing sleep, so sh's own
	// cmdline names the sandbox dir.
	shim := exec.Command("/bin/busybox", "sh", "-c", "sleep 60; : "+filepath.Join(s.RunDir, "sandboxes", "sb1", "shim"))
	startProcess(t, shim)

	leaks := waitLeaks(t, s, func(ls []Leak) bool { return countKind(ls, KindProcess) >= 2 })
	want := map[string][]string{
		KindMount:   {rootfs + " (tmpfs"},
		KindLoop:    {dev + " backed by " + disk},
		KindRunc:    {filepath.Join(s.RuncRoot, "sb1")},
		KindFile:    {filepath.Join(s.RunDir, "sandboxes", "sb1"), filepath.Join(s.DataDir, "pool", "sandboxes", "sb1")},
		KindProcess: {fmt.Sprintf("pid %d ", jailed.Process.Pid), fmt.Sprintf("pid %d ", shim.Process.Pid)},
		KindCgroup:  cgroups,
	}
	for kind, whats := range want {
		for _, w := range whats {
			if !hasLeak(leaks, kind, w) {
				t.Errorf("missing %s leak %q in:\n%v", kind, w, leaks)
			}
		}
	}
	if len(cgroups) == 0 {
		t.Error("no cgroup hierarchy found to test")
	}
	for _, l := range leaks {
		if strings.Contains(l.What, "pool.img") || l.Kind == KindMount && strings.HasPrefix(l.What, filepath.Join(s.DataDir, "pool")+" ") {
			t.Errorf("allowed resource reported: %v", l)
		}
		if l.Kind == KindProcess && strings.Contains(l.What, fmt.Sprintf("pid %d ", os.Getpid())) {
			t.Errorf("reported itself: %v", l)
		}
	}
	if s := (Leak{Kind: KindLoop, What: "x"}).String(); s != "loop: x" {
		t.Errorf("String() = %q", s)
	}

	// Clean up everything that is a leak; only the allowed resources stay.
	stop(jailed)
	stop(shim)
	_ = unix.Unmount(rootfs, 0)
	_ = loopdev.Detach(dev)
	for _, c := range cgroups {
		_ = os.Remove(c)
	}
	for _, d := range []string{s.RuncRoot, filepath.Join(s.RunDir, "sandboxes"), filepath.Join(s.DataDir, "pool", "sandboxes")} {
		if err := os.RemoveAll(d); err != nil {
			t.Fatal(err)
		}
	}
	waitLeaks(t, s, func(ls []Leak) bool { return len(ls) == 0 })
	AssertNone(t, ctx, s)
}

func TestCheckMissingDirs(t *testing.T) {
	base := t.TempDir()
	leaks, err := Check(context.Background(), Scope{
		DataDir: filepath.Join(base, "nope"), RunDir: filepath.Join(base, "nope2"), RuncRoot: filepath.Join(base, "nope3"),
	})
	if err != nil || len(leaks) != 0 {
		t.Fatalf("Check on absent dirs = %v, %v", leaks, err)
	}
}

// waitLeaks polls because processes and loop devices appear and vanish
// asynchronously.
func waitLeaks(t *testing.T, s Scope, ok func([]Leak) bool) []Leak {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		leaks, err := Check(context.Background(), s)
		if err != nil {
			t.Fatal(err)
		}
		if ok(leaks) || time.Now().After(deadline) {
			return leaks
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func countKind(ls []Leak, kind string) int {
	n := 0
	for _, l := range ls {
		if l.Kind == kind {
			n++
		}
	}
	return n
}

func hasLeak(ls []Leak, kind, prefix string) bool {
	for _, l := range ls {
		if l.Kind == kind && strings.HasPrefix(l.What, prefix) {
			return true
		}
	}
	return false
}

func copyFile(t *testing.T, src, dst string) {
	t.Helper()
	in, err := os.Open(src)
	if err != nil {
		t.Skipf("%s: %v", src, err)
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
}
