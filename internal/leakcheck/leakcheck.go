// Package leakcheck finds what a cube component left behind on the host:
// mounts, loop devices, cgroups, runc state, sandbox files and processes.
// Every integration suite calls AssertNone after its sandboxes are gone, so
// a leak fails the test that caused it instead of a later, unrelated one.
//
// Check only reads; it never cleans up.
package leakcheck

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"

	"github.com/cubesandbox/cube/internal/loopdev"
	"github.com/cubesandbox/cube/internal/runtime/userns"
)

// Leak kinds.
const (
	KindMount   = "mount"
	KindLoop    = "loop"
	KindCgroup  = "cgroup"
	KindRunc    = "runc"
	KindFile    = "file"
	KindProcess = "process"
	KindRunsc   = "runsc"
)

// Scope is what one test suite (or one cubelet) owns.
type Scope struct {
	DataDir  string
	RunDir   string
	RuncRoot string
	// RunscRoot is the gvisor driver's runsc --root (runsc.go): state
	// files in it and sandbox/gofer processes started with it are leaks.
	RunscRoot  string
	CgroupName string // cgroup parent directly under each hierarchy root, e.g. "cube-test-abc"
	// AllowMounts are mount targets that may stay (the pool mount itself).
	AllowMounts []string
	// AllowLoopBacking are backing files whose loop devices may stay (the pool image).
	AllowLoopBacking []string
	// NetPrefix and NetnsDir scope a network-agent (net.go): host links
	// named NetPrefix-*, the host nftables table NetPrefix, and namespaces
	// pinned in NetnsDir.
	NetPrefix string
	NetnsDir  string
	// VMRoot is the vm driver's state root (vm.go): state dirs in it, and
	// QEMU processes with their QMP socket under RunDir, are leaks.
	VMRoot string
}

// Leak is one thing left behind.
type Leak struct {
	Kind string // one of the Kind constants
	What string
}

func (l Leak) String() string { return l.Kind + ": " + l.What }

// Check lists every leak in scope. Directories that do not exist hold no
// leaks. The result is sorted by kind, then description.
func Check(ctx context.Context, s Scope) ([]Leak, error) {
	first, err := check(ctx, s)
	if err != nil || len(first) == 0 {
		return first, err
	}
	// A leak persists; a short-lived helper (a `runsc list` from a health
	// check, a loop device the kernel is still auto-clearing) does not.
	// Report only what is still there a moment later.
	select {
	case <-ctx.Done():
		return first, nil
	case <-time.After(500 * time.Millisecond):
	}
	second, err := check(ctx, s)
	if err != nil {
		// The first check's answer stands, unconfirmed: a failed recheck
		// must not hide a leak.
		return first, nil //nolint:nilerr // see above
	}
	seen := map[string]bool{}
	for _, l := range first {
		seen[l.String()] = true
	}
	var out []Leak
	for _, l := range second {
		if seen[l.String()] {
			out = append(out, l)
		}
	}
	return out, nil
}

func check(ctx context.Context, s Scope) ([]Leak, error) {
	s.DataDir, s.RunDir, s.RuncRoot = canon(s.DataDir), canon(s.RunDir), canon(s.RuncRoot)
	owned := []string{s.DataDir, s.RunDir}
	mounts, err := mountinfo.GetMounts(nil)
	if err != nil {
		return nil, fmt.Errorf("leakcheck: read mountinfo: %w", err)
	}
	var leaks []Leak
	add := func(kind, format string, args ...any) {
		leaks = append(leaks, Leak{Kind: kind, What: fmt.Sprintf(format, args...)})
	}

	allowMount := canonAll(s.AllowMounts)
	for _, m := range mounts {
		if under(m.Mountpoint, owned...) && !slices.Contains(allowMount, m.Mountpoint) {
			add(KindMount, "%s (%s from %s)", m.Mountpoint, m.FSType, m.Source)
		}
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}

	devs, err := loopdev.List()
	if err != nil {
		return nil, fmt.Errorf("leakcheck: %w", err)
	}
	allowLoop := canonAll(s.AllowLoopBacking)
	for _, d := range devs {
		back := strings.TrimSuffix(d.BackingFile, " (deleted)")
		if under(back, s.DataDir) && !slices.Contains(allowLoop, back) {
			add(KindLoop, "%s backed by %s", d.Path, d.BackingFile)
		}
	}

	if s.CgroupName != "" {
		for _, parent := range cgroupParents(mounts, s.CgroupName) {
			for _, child := range subdirs(parent) {
				add(KindCgroup, "%s", child)
			}
		}
	}

	if s.RuncRoot != "" {
		for _, c := range subdirs(s.RuncRoot) {
			add(KindRunc, "%s", c)
		}
		// The runc driver's user namespaces (internal/runtime/runc,
		// userns.go): each sandbox's mount directory and its host ID
		// block in the host's allocation file.
		for _, c := range subdirs(s.RuncRoot + "-userns") {
			add(KindFile, "%s", c)
		}
		if root, err := filepath.Abs(s.RuncRoot); err == nil {
			if a, err := userns.NewAllocator("", root, 0, 0); err == nil {
				ranges, _ := a.All()
				for id := range ranges {
					add(KindRunc, "user namespace ID range of %s", id)
				}
			}
		}
	}

	for _, d := range []string{join(s.DataDir, "pool", "sandboxes"), join(s.RunDir, "sandboxes")} {
		if d == "" {
			continue
		}
		ents, _ := os.ReadDir(d)
		for _, e := range ents {
			add(KindFile, "%s", filepath.Join(d, e.Name()))
		}
	}

	if err := ctx.Err(); err != nil {
		return nil, err
	}
	leaks = append(leaks, processes(s)...)
	leaks = append(leaks, netLeaks(s)...)
	leaks = append(leaks, runscLeaks(s)...)
	leaks = append(leaks, vmLeaks(s)...)

	slices.SortFunc(leaks, func(a, b Leak) int {
		return strings.Compare(a.String(), b.String())
	})
	return leaks, nil
}

// cgroupParents finds <hierarchy>/<name> for every cgroup v1 controller
// mount and the v2 unified mount, so hybrid hosts (cpu, memory, ... plus
// /sys/fs/cgroup/unified) and pure v2 hosts are both covered. Co-mounted
// hierarchies (cpu,cpuacct) mounted twice appear once.
func cgroupParents(mounts []*mountinfo.Info, name string) []string {
	var out []string
	seen := map[string]bool{}
	for _, m := range mounts {
		if m.FSType != "cgroup" && m.FSType != "cgroup2" {
			continue
		}
		key := strconv.Itoa(m.Major) + ":" + strconv.Itoa(m.Minor) + m.Root
		if seen[key] {
			continue
		}
		seen[key] = true
		out = append(out, filepath.Join(m.Mountpoint, name))
	}
	return out
}

// processes reports processes living in, or pointing at, the scope: their
// root is under DataDir/RunDir (a sandbox's pivot_root) or their command
// line names RunDir/sandboxes (runtime shims, helpers).
func processes(s Scope) []Leak {
	self := os.Getpid()
	ents, _ := os.ReadDir("/proc")
	sandboxes := join(s.RunDir, "sandboxes")
	var leaks []Leak
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self {
			continue
		}
		proc := filepath.Join("/proc", e.Name())
		comm, _ := os.ReadFile(filepath.Join(proc, "comm"))
		desc := fmt.Sprintf("pid %d (%s)", pid, strings.TrimSpace(string(comm)))
		if root, err := os.Readlink(filepath.Join(proc, "root")); err == nil && root != "/" && under(root, s.DataDir, s.RunDir) {
			leaks = append(leaks, Leak{Kind: KindProcess, What: desc + " root " + root})
			continue
		}
		if sandboxes == "" {
			continue
		}
		cmd, _ := os.ReadFile(filepath.Join(proc, "cmdline"))
		if cl := strings.ReplaceAll(string(cmd), "\x00", " "); strings.Contains(cl, sandboxes) {
			leaks = append(leaks, Leak{Kind: KindProcess, What: desc + " cmdline " + strings.TrimSpace(cl)})
		}
	}
	return leaks
}

// AssertNone fails t with every leak in scope.
func AssertNone(t testing.TB, ctx context.Context, s Scope) {
	t.Helper()
	leaks, err := Check(ctx, s)
	if err != nil {
		t.Errorf("leakcheck: %v", err)
		return
	}
	if len(leaks) == 0 {
		return
	}
	lines := make([]string, len(leaks))
	for i, l := range leaks {
		lines[i] = "  " + l.String()
	}
	t.Errorf("leakcheck: %d leak(s):\n%s", len(leaks), strings.Join(lines, "\n"))
}

// canon makes a path comparable with what the kernel reports: absolute,
// clean and with symlinks resolved where it exists.
func canon(p string) string {
	if p == "" {
		return ""
	}
	abs, err := filepath.Abs(p)
	if err != nil {
		return filepath.Clean(p)
	}
	if resolved, err := filepath.EvalSymlinks(abs); err == nil {
		return resolved
	}
	return abs
}

func canonAll(ps []string) []string {
	out := make([]string, len(ps))
	for i, p := range ps {
		out[i] = canon(p)
	}
	return out
}

// under reports whether p is one of dirs or inside one; empty dirs match
// nothing.
func under(p string, dirs ...string) bool {
	for _, d := range dirs {
		if d != "" && (p == d || strings.HasPrefix(p, d+string(filepath.Separator))) {
			return true
		}
	}
	return false
}

func join(base string, elem ...string) string {
	if base == "" {
		return ""
	}
	return filepath.Join(append([]string{base}, elem...)...)
}

func subdirs(dir string) []string {
	ents, _ := os.ReadDir(dir)
	var out []string
	for _, e := range ents {
		if e.IsDir() {
			out = append(out, filepath.Join(dir, e.Name()))
		}
	}
	return out
}
