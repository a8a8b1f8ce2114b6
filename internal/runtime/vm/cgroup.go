package vm

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/cubesandbox/cube/internal/runtime/cgroups"
)

// cgroupRoots is every cgroup hierarchy's mount point (hybrid, pure v1
// and pure v2 hosts alike).
func cgroupRoots() ([]string, error) { return cgroups.Mounts() }

// cgroupLimits are the values written into the sandbox's cgroup.
type cgroupLimits struct {
	MemoryBytes int64 // 0 = none
	CPUQuotaUS  int64 // per 100 ms period; 0 = none
	Pids        int64
}

const cpuPeriodUS = 100000

// joinCgroup creates path in every hierarchy, writes the limits where the
// controller lives, and moves pid (all its threads) in. On error it
// removes what it created.
func joinCgroup(path string, pid int, l cgroupLimits) (err error) {
	if p := strings.Trim(filepath.Clean(path), "/"); p == "" || p == "." || strings.HasPrefix(p, "..") {
		return fmt.Errorf("cgroup path %q: want a path below the hierarchy root", path)
	}
	roots, err := cgroupRoots()
	if err != nil {
		return err
	}
	var made []string
	defer func() {
		if err != nil {
			for i := len(made) - 1; i >= 0; i-- {
				_ = os.Remove(made[i])
			}
		}
	}()
	applied := map[string]bool{}
	for _, r := range roots {
		dir := filepath.Join(r, path)
		created, err := mkCgroup(r, path)
		made = append(made, created...)
		if err != nil {
			return err
		}
		writes := map[string]string{}
		if l.MemoryBytes > 0 {
			writes["memory.limit_in_bytes"] = strconv.FormatInt(l.MemoryBytes, 10) // v1
			writes["memory.max"] = strconv.FormatInt(l.MemoryBytes, 10)            // v2
		}
		if l.CPUQuotaUS > 0 {
			writes["cpu.cfs_period_us"] = strconv.Itoa(cpuPeriodUS)
			writes["cpu.cfs_quota_us"] = strconv.FormatInt(l.CPUQuotaUS, 10)
			writes["cpu.max"] = fmt.Sprintf("%d %d", l.CPUQuotaUS, cpuPeriodUS)
		}
		if l.Pids > 0 {
			writes["pids.max"] = strconv.FormatInt(l.Pids, 10)
		}
		// Period before quota: v1 rejects a quota the old period makes invalid.
		for _, f := range []string{"memory.limit_in_bytes", "memory.max", "cpu.cfs_period_us", "cpu.cfs_quota_us", "cpu.max", "pids.max"} {
			v, ok := writes[f]
			if !ok || !exists(filepath.Join(dir, f)) {
				continue
			}
			if err := os.WriteFile(filepath.Join(dir, f), []byte(v), 0); err != nil {
				return fmt.Errorf("cgroup %s: write %s=%s: %w", dir, f, v, err)
			}
			applied[strings.Split(f, ".")[0]] = true
		}
		// A v2 leaf must not enable controllers for children; a v1
		// hierarchy has no such file. cgroup.procs moves every thread.
		if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
			return fmt.Errorf("cgroup %s: add pid %d: %w", dir, pid, err)
		}
	}
	// A limit no hierarchy could take is an error, not a VM without one.
	for ctl, asked := range map[string]bool{"memory": l.MemoryBytes > 0, "cpu": l.CPUQuotaUS > 0} {
		if asked && !applied[ctl] {
			return fmt.Errorf("cgroup %s: no hierarchy has the %s controller for the sandbox's limit", path, ctl)
		}
	}
	return nil
}

// enableControllers makes a cgroup v2 parent pass the memory, cpu and pids
// controllers down to its children, so the sandbox's cgroup has the files
// its limits are written to. A no-op on v1 hierarchies (no such file) and
// for controllers the parent does not have; a parent that already passes
// them is left alone.
func enableControllers(parent string) {
	have, err := os.ReadFile(filepath.Join(parent, "cgroup.controllers"))
	if err != nil {
		return
	}
	on, _ := os.ReadFile(filepath.Join(parent, "cgroup.subtree_control"))
	enabled := strings.Fields(string(on))
	var add []string
	for _, c := range []string{"memory", "cpu", "pids"} {
		if slices.Contains(strings.Fields(string(have)), c) && !slices.Contains(enabled, c) {
			add = append(add, "+"+c)
		}
	}
	if len(add) > 0 {
		// Fails where the parent holds processes itself (the v2 "no
		// internal processes" rule); the limits check in joinCgroup then
		// says which limit could not be applied.
		_ = os.WriteFile(filepath.Join(parent, "cgroup.subtree_control"), []byte(strings.Join(add, " ")), 0)
	}
}

// mkCgroup creates root/path level by level and returns the directories
// it created, outermost first. A new cgroup v1 cpuset starts with no CPUs
// and no memory nodes, and a task cannot join it ("no space left on
// device"): each empty level gets its parent's.
func mkCgroup(root, path string) ([]string, error) {
	var made []string
	dir := root
	for _, part := range strings.Split(strings.Trim(filepath.Clean(path), "/"), "/") {
		parent := dir
		dir = filepath.Join(dir, part)
		enableControllers(parent)
		err := os.Mkdir(dir, 0o755)
		if err != nil && !errors.Is(err, fs.ErrExist) {
			return made, fmt.Errorf("create cgroup %s: %w", dir, err)
		}
		if err == nil {
			made = append(made, dir)
		}
		// Existing levels too: a concurrent Start may have created this
		// one a moment ago and not filled it in yet.
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			cur, err := os.ReadFile(filepath.Join(dir, f))
			if err != nil || strings.TrimSpace(string(cur)) != "" || !exists(filepath.Join(dir, "cgroup.clone_children")) {
				continue // not a v1 cpuset (in v2 empty means "inherit")
			}
			val, err := os.ReadFile(filepath.Join(parent, f))
			if err != nil {
				return made, fmt.Errorf("cgroup %s: read %s: %w", parent, f, err)
			}
			if err := os.WriteFile(filepath.Join(dir, f), val, 0); err != nil {
				return made, fmt.Errorf("cgroup %s: write %s: %w", dir, f, err)
			}
		}
	}
	return made, nil
}

// addToCgroup moves pid into path in every hierarchy where path exists:
// the driver's zstd for a VM's memory image works for that VM, so its CPU
// and memory are charged to the sandbox, as QEMU's own are.
func addToCgroup(path string, pid int) error {
	if path == "" {
		return nil
	}
	roots, err := cgroupRoots()
	if err != nil {
		return err
	}
	var errs []error
	for _, r := range roots {
		dir := filepath.Join(r, path)
		if !exists(dir) {
			continue
		}
		if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
			errs = append(errs, fmt.Errorf("cgroup %s: add pid %d: %w", dir, pid, err))
		}
	}
	return errors.Join(errs...)
}
