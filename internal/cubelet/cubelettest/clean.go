package cubelettest

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/cubesandbox/cube/internal/runtime/userns"
	"github.com/cubesandbox/cube/internal/storage"
)

// forceClean removes, without the cubelet, everything an env's sandboxes
// may hold: the safety net behind a failed test, never the thing tested.
func forceClean(ctx context.Context, e *Env) {
	c := e.Config
	if out, err := exec.CommandContext(ctx, c.Runc.Binary, "--root", c.Runc.Root, "list", "-q").Output(); err == nil {
		for _, id := range strings.Fields(string(out)) {
			_ = exec.CommandContext(ctx, c.Runc.Binary, "--root", c.Runc.Root, "delete", "--force", id).Run()
		}
	}
	// The runc driver's idmapped views and sysfs mounts of the
	// sandboxes deleted above (its Stop would have removed them).
	views := c.Runc.Root + "-userns"
	ids, _ := os.ReadDir(views)
	for _, id := range ids {
		for _, m := range []string{"sys", "rootfs"} {
			_ = syscall.Unmount(filepath.Join(views, id.Name(), m), syscall.MNT_DETACH)
			_ = os.Remove(filepath.Join(views, id.Name(), m)) // never RemoveAll: a mount may remain
		}
		_ = os.Remove(filepath.Join(views, id.Name()))
	}
	if root, err := filepath.Abs(c.Runc.Root); err == nil {
		if a, err := userns.NewAllocator("", root, 0, 0); err == nil {
			ids, _ := a.IDs()
			for _, id := range ids {
				_ = a.Release(id)
			}
		}
	}
	killQEMU(c.Node.RunDir)
	_ = os.RemoveAll(c.VM.Root)
	runRoot := filepath.Join(c.Node.RunDir, "sandboxes")
	ents, _ := os.ReadDir(runRoot)
	for _, ent := range ents {
		_ = storage.UnmountDisk(ctx, filepath.Join(runRoot, ent.Name(), "rootfs"),
			filepath.Join(c.PoolDir(), "sandboxes", ent.Name(), "disk.img"))
	}
	for _, root := range cgroupRoots() {
		dir := filepath.Join(root, c.Node.CgroupParent)
		kids, _ := os.ReadDir(dir)
		for _, k := range kids {
			if k.IsDir() {
				_ = os.Remove(filepath.Join(dir, k.Name()))
			}
		}
		_ = os.Remove(dir)
	}
}

// killQEMU kills the VMs whose sockets lie under runDir (daemonized QEMU
// is not our child: only its command line ties it to this env).
func killQEMU(runDir string) {
	procs, _ := os.ReadDir("/proc")
	for _, e := range procs {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmd, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil || !strings.Contains(string(cmd), "qemu") || !strings.Contains(string(cmd), runDir+"/") {
			continue
		}
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}

// cgroupRoots lists the mount points of every cgroup hierarchy.
func cgroupRoots() []string {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	var out []string
	for _, line := range strings.Split(string(data), "\n") {
		pre, post, ok := strings.Cut(line, " - ")
		if !ok {
			continue
		}
		f := strings.Fields(pre)
		if len(f) < 5 {
			continue
		}
		if fs := strings.Fields(post); len(fs) > 0 && (fs[0] == "cgroup" || fs[0] == "cgroup2") {
			out = append(out, f[4])
		}
	}
	return out
}
