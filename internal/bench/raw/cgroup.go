package raw

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/cubesandbox/cube/internal/runtime/cgroups"
)

// CgroupMount is one mounted cgroup hierarchy.
type CgroupMount struct {
	Dir         string
	V2          bool
	Controllers []string // v1: the controllers (and name=...) of the hierarchy
}

// CgroupMounts lists every cgroup hierarchy from mountinfo, so hybrid,
// pure v1 and pure v2 hosts are handled by the same code.
func CgroupMounts() ([]CgroupMount, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []CgroupMount
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		if !ok {
			continue
		}
		pf, qf := strings.Fields(pre), strings.Fields(post)
		if len(pf) < 5 || len(qf) < 3 {
			continue
		}
		switch qf[0] {
		case "cgroup2":
			out = append(out, CgroupMount{Dir: pf[4], V2: true})
		case "cgroup":
			var ctrls []string
			for _, o := range strings.Split(qf[2], ",") {
				if o != "rw" && o != "ro" && !strings.HasPrefix(o, "relatime") {
					ctrls = append(ctrls, o)
				}
			}
			out = append(out, CgroupMount{Dir: pf[4], Controllers: ctrls})
		}
	}
	return out, sc.Err()
}

// CgroupDir returns where the cgroup of pid for controller lives: a v1
// hierarchy carrying controller, else the v2 hierarchy. ok is false when
// neither exists.
func CgroupDir(pid int, controller string) (dir string, v2 bool, err error) {
	mounts, err := CgroupMounts()
	if err != nil {
		return "", false, err
	}
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return "", false, err
	}
	var v2path string
	v1 := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(data)), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		if parts[0] == "0" && parts[1] == "" {
			v2path = parts[2]
			continue
		}
		for _, c := range strings.Split(parts[1], ",") {
			v1[c] = parts[2]
		}
	}
	for _, m := range mounts {
		if m.V2 {
			continue
		}
		for _, c := range m.Controllers {
			if p, ok := v1[c]; ok && c == controller {
				return filepath.Join(m.Dir, p), false, nil
			}
		}
	}
	for _, m := range mounts {
		if m.V2 && v2path != "" {
			return filepath.Join(m.Dir, v2path), true, nil
		}
	}
	return "", false, fmt.Errorf("no %s cgroup for pid %d", controller, pid)
}

// RemoveCgroupTree removes cgroupPath and the cgroups directly under it,
// in every hierarchy.
func RemoveCgroupTree(cgroupPath string) error {
	dirs, err := cgroups.Dirs(cgroupPath)
	if err != nil {
		return err
	}
	kids := map[string]bool{}
	for _, d := range dirs {
		ents, _ := os.ReadDir(d)
		for _, e := range ents {
			if e.IsDir() {
				kids[e.Name()] = true
			}
		}
	}
	var errs []error
	for k := range kids {
		_, err := cgroups.Remove(filepath.Join(cgroupPath, k), 2*time.Second)
		errs = append(errs, err)
	}
	_, err = cgroups.Remove(cgroupPath, 2*time.Second)
	return errors.Join(append(errs, err)...)
}

// CgroupProcs lists the PIDs in a cgroup directory.
func CgroupProcs(dir string) ([]int, error) {
	data, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		return nil, err
	}
	var pids []int
	for _, f := range strings.Fields(string(data)) {
		if p, err := strconv.Atoi(f); err == nil {
			pids = append(pids, p)
		}
	}
	return pids, nil
}

// Freezer is the freezer of one cgroup: v1 freezer.state or v2
// cgroup.freeze. Freeze and Thaw return once the kernel reports the new
// state, which is when `runc pause` returns too.
type Freezer struct {
	dir string
	v2  bool
}

// FreezerOf is the freezer of pid's cgroup.
func FreezerOf(pid int) (*Freezer, error) {
	dir, v2, err := CgroupDir(pid, "freezer")
	if err != nil {
		return nil, err
	}
	return &Freezer{dir: dir, v2: v2}, nil
}

// Freeze freezes the cgroup and waits until the kernel reports it frozen.
func (f *Freezer) Freeze() error { return f.set(true) }

// Thaw thaws the cgroup and waits until the kernel reports it thawed.
func (f *Freezer) Thaw() error { return f.set(false) }

func (f *Freezer) set(frozen bool) error {
	file, val, stateFile := "freezer.state", "FROZEN", "freezer.state"
	if !frozen {
		val = "THAWED"
	}
	if f.v2 {
		file, stateFile, val = "cgroup.freeze", "cgroup.events", "1"
		if !frozen {
			val = "0"
		}
	}
	if err := os.WriteFile(filepath.Join(f.dir, file), []byte(val), 0); err != nil {
		return err
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		b, err := os.ReadFile(filepath.Join(f.dir, stateFile))
		if err != nil {
			return err
		}
		s := string(b)
		if f.v2 && strings.Contains(s, "frozen "+val+"\n") || !f.v2 && strings.TrimSpace(s) == val {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("freezer %s: still %q", f.dir, strings.TrimSpace(s))
		}
		time.Sleep(50 * time.Microsecond)
	}
}
