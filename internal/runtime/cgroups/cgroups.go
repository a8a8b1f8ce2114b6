// Package cgroups finds and removes a sandbox's cgroup in every mounted
// cgroup hierarchy (v1 controllers, named v1 hierarchies and cgroup2), so
// hybrid, pure v1 and pure v2 hosts are handled by the same code. The OCI
// drivers (runc, gvisor) and the VM driver share it: each may leave
// hierarchy directories behind that only a sweep of every mount removes.
package cgroups

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Mounts returns the mount point of every cgroup hierarchy (v1
// controllers, named v1 hierarchies and cgroup2) visible to this process.
// It reads mountinfo instead of assuming a layout so that hybrid, pure v1
// and pure v2 hosts are all handled by the same code.
func Mounts() ([]string, error) {
	ms, err := cachedMounts()
	if err != nil {
		return nil, err
	}
	out := make([]string, len(ms))
	for i, m := range ms {
		out[i] = m.path
	}
	return out, nil
}

// V1Mount is a mounted cgroup v1 hierarchy.
type V1Mount struct {
	// Path is its mount point.
	Path string
	// Root is the cgroup mounted there: "/" for the whole hierarchy;
	// another when this process's view of it is a subtree (a container
	// sharing the host's cgroup namespace). /proc/<pid>/cgroup names
	// cgroups from the hierarchy's root, so Path shows a cgroup cg at
	// Path + cg less Root.
	Root string
}

// V1MountFor returns the mount of the cgroup v1 hierarchy of
// controllers, as /proc/<pid>/cgroup names a hierarchy ("cpu,cpuacct",
// "name=systemd"); ok is false when none is mounted.
func V1MountFor(controllers string) (m V1Mount, ok bool, err error) {
	ms, err := cachedMounts()
	if err != nil {
		return V1Mount{}, false, err
	}
	m, ok = v1MountIn(ms, controllers)
	return m, ok, nil
}

func v1MountIn(ms []hierarchy, controllers string) (V1Mount, bool) {
	want := strings.Split(controllers, ",")
	for _, m := range ms {
		if m.v2 {
			continue
		}
		if !slices.ContainsFunc(want, func(c string) bool { return !m.holds(c) }) {
			return V1Mount{Path: m.path, Root: m.root}, true
		}
	}
	return V1Mount{}, false
}

// V1Mounts returns the mount points of the cgroup v1 hierarchies.
func V1Mounts() ([]string, error) {
	ms, err := cachedMounts()
	if err != nil {
		return nil, err
	}
	var out []string
	for _, m := range ms {
		if !m.v2 {
			out = append(out, m.path)
		}
	}
	return out, nil
}

// hierarchy is one mounted cgroup hierarchy.
type hierarchy struct {
	path string
	v2   bool
	// memory: the hierarchy holds the memory controller (a v1 mount
	// with "memory" in its options; cgroup2, whose controllers are per
	// cgroup, always counts).
	memory bool
	// opts are a v1 mount's super options, comma-separated: its
	// controllers and name= among them.
	opts string
	// root is the cgroup mounted at path (mountinfo's root field).
	root string
}

// holds reports whether the hierarchy has controller c's files: a v1
// hierarchy only its own controllers', cgroup2 every one's.
func (h hierarchy) holds(c string) bool {
	return h.v2 || slices.Contains(strings.Split(h.opts, ","), c)
}

// The cgroup hierarchies are mounted at boot and practically never
// change, while mountinfo grows by a few lines with every running sandbox
// (its disk, its id-mapped bind): read on every call (the runtime watch
// arms one per create, the usage sampler reads every sandbox's memory),
// it cost cubelet time in proportion to the sandboxes up, per sandbox. So
// the list is read again only once it is older than mountsTTL, by one
// caller while the others wait for it.
const mountsTTL = 5 * time.Second

var mounts struct {
	sync.Mutex
	at   time.Time
	list []hierarchy
}

func cachedMounts() ([]hierarchy, error) {
	mounts.Lock()
	defer mounts.Unlock()
	if mounts.list != nil && time.Since(mounts.at) < mountsTTL {
		return mounts.list, nil
	}
	list, err := readMounts()
	if err != nil {
		return nil, err
	}
	mounts.list, mounts.at = list, time.Now()
	return list, nil
}

func readMounts() ([]hierarchy, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return parseMounts(f)
}

// parseMounts reads the cgroup hierarchies of a mountinfo.
func parseMounts(r io.Reader) ([]hierarchy, error) {
	out := []hierarchy{}
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		// Fields: id parent maj:min root mountpoint opts [optional...] - fstype source superopts
		fields := strings.Fields(sc.Text())
		sep := -1
		for i, f := range fields {
			if f == "-" {
				sep = i
				break
			}
		}
		if sep < 0 || sep+1 >= len(fields) || len(fields) < 5 {
			continue
		}
		switch fields[sep+1] {
		case "cgroup2":
			out = append(out, hierarchy{path: unescapeMountinfo(fields[4]), v2: true, memory: true})
		case "cgroup":
			// The super options are the last field: an empty source
			// leaves two spaces, which Fields merges.
			opts := strings.Split(fields[len(fields)-1], ",")
			out = append(out, hierarchy{path: unescapeMountinfo(fields[4]), memory: slices.Contains(opts, "memory"),
				opts: fields[len(fields)-1], root: unescapeMountinfo(fields[3])})
		}
	}
	return out, sc.Err()
}

// memoryFiles hands each to the contents of cgroupPath's v1File (in a v1
// hierarchy) or v2File (in cgroup2), for each hierarchy holding the
// memory controller where the file exists.
func memoryFiles(cgroupPath, v1File, v2File string, each func([]byte)) error {
	ms, err := cachedMounts()
	if err != nil {
		return err
	}
	for _, m := range ms {
		if !m.memory {
			continue
		}
		d := filepath.Join(m.path, cgroupPath)
		if d == m.path {
			continue // never the hierarchy root
		}
		name := v1File
		if m.v2 {
			name = v2File
		}
		if b, err := os.ReadFile(filepath.Join(d, name)); err == nil {
			each(b)
		}
	}
	return nil
}

// unescapeMountinfo undoes the kernel's octal escaping of space, tab,
// newline and backslash in mountinfo paths.
func unescapeMountinfo(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			var v byte
			ok := true
			for _, c := range []byte(s[i+1 : i+4]) {
				if c < '0' || c > '7' {
					ok = false
					break
				}
				v = v*8 + (c - '0')
			}
			if ok {
				b.WriteByte(v)
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// Dirs lists the directories of cgroupPath that exist in any hierarchy.
// The hierarchy roots themselves are never listed.
func Dirs(cgroupPath string) ([]string, error) {
	mounts, err := Mounts()
	if err != nil {
		return nil, err
	}
	var dirs []string
	for _, m := range mounts {
		d := filepath.Join(m, cgroupPath)
		if d == m {
			continue // never the hierarchy root
		}
		if _, err := os.Stat(d); err == nil {
			dirs = append(dirs, d)
		}
	}
	return dirs, nil
}

// Remove removes cgroupPath from every hierarchy, retrying EBUSY for up to
// timeout while the kernel releases the last task. runc and runsc normally
// do this in delete, but they skip hierarchies they did not join (for
// example the named systemd hierarchy on some versions) and give up on
// EBUSY while the last killed task is still being torn down; a short retry
// covers that. It returns the directories it found (and removed unless err
// says otherwise). A path present in no hierarchy is not an error.
func Remove(cgroupPath string, timeout time.Duration) (found []string, err error) {
	dirs, err := Dirs(cgroupPath)
	if err != nil {
		return nil, fmt.Errorf("find cgroup %s: %w", cgroupPath, err)
	}
	var errs []error
	for _, d := range dirs {
		if err := rmdirRetry(d, timeout); err != nil {
			errs = append(errs, err)
		}
	}
	return dirs, errors.Join(errs...)
}

func rmdirRetry(dir string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		// A cgroup directory is removed with rmdir(2) alone: its control
		// files are not real files and cannot be unlinked.
		err := os.Remove(dir)
		if err == nil || errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("remove cgroup %s: %w", dir, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// OOMKills is how many processes the kernel's OOM killer has killed in
// cgroupPath: the oom_kill count of cgroup v2's memory.events or v1's
// memory.oom_control, whichever hierarchy holds the memory controller (the
// largest when both do). A cgroup found nowhere counts 0.
func OOMKills(cgroupPath string) (int64, error) {
	var most int64
	err := memoryFiles(cgroupPath, "memory.oom_control", "memory.events", func(b []byte) {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "oom_kill "); ok {
				if n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64); err == nil && n > most {
					most = n
				}
			}
		}
	})
	return most, err
}

// MemoryUsage is the memory charged to cgroupPath in bytes: cgroup v2's
// memory.current or v1's memory.usage_in_bytes, the largest where both
// hierarchies hold the controller. A cgroup found nowhere uses 0.
func MemoryUsage(cgroupPath string) (int64, error) {
	var most int64
	err := memoryFiles(cgroupPath, "memory.usage_in_bytes", "memory.current", func(b []byte) {
		if n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); err == nil && n > most {
			most = n
		}
	})
	return most, err
}

// Kill SIGKILLs every process in cgroupPath (and the cgroups below it) in
// every hierarchy, repeating until none is left or timeout passes, and
// reports how many it signalled. A runtime that was itself killed while
// starting a sandbox (runsc cut off between forking its sandbox and gofer
// processes and recording them) leaves processes its delete does not know
// of; they keep the cgroup busy, so whoever removes the cgroup kills them
// first. A path present in no hierarchy is not an error.
func Kill(cgroupPath string, timeout time.Duration) (int, error) {
	dirs, err := Dirs(cgroupPath)
	if err != nil {
		return 0, fmt.Errorf("find cgroup %s: %w", cgroupPath, err)
	}
	killed := map[int]bool{}
	deadline := time.Now().Add(timeout)
	for {
		left := 0
		for _, d := range dirs {
			_ = filepath.WalkDir(d, func(p string, e fs.DirEntry, werr error) error {
				if werr != nil || !e.IsDir() {
					return nil //nolint:nilerr // a cgroup removed under the walk holds nothing
				}
				for _, pid := range ReadPIDs(filepath.Join(p, "cgroup.procs")) {
					left++
					// ESRCH: gone between the read and the kill.
					_ = syscall.Kill(pid, syscall.SIGKILL)
					killed[pid] = true
				}
				return nil
			})
		}
		if left == 0 {
			return len(killed), nil
		}
		if time.Now().After(deadline) {
			return len(killed), fmt.Errorf("kill processes of cgroup %s: %d still there after %s", cgroupPath, left, timeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// ReadPIDs reads a cgroup.procs file; a missing or unreadable one holds
// nothing.
func ReadPIDs(path string) []int {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil
	}
	var out []int
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil && pid > 0 {
			out = append(out, pid)
		}
	}
	return out
}

// Stats is a cgroup's resource use at one moment.
type Stats struct {
	// CPU is the CPU time the cgroup's processes have used since it was
	// made (cumulative).
	CPU time.Duration
	// Memory is the memory charged to the cgroup (anonymous, page cache
	// and kernel memory); RSS and Cache are its anonymous and file-backed
	// parts.
	Memory, RSS, Cache int64
	// Shmem is the shared memory (tmpfs, shm) part of Memory: a gVisor
	// sandbox's guest memory, which its sentry keeps in one memory file.
	Shmem int64
	// MemoryLimit is the cgroup's memory limit, 0 when it has none.
	MemoryLimit int64
	// Pids is the number of tasks in the cgroup.
	Pids int64
}

// ReadStats reads cgroupPath's resource use from every hierarchy in mounts
// (Mounts' list, read once by a caller that samples many cgroups). Each
// figure is cgroup v2's file or v1's, the largest where both hierarchies
// hold the controller, as MemoryUsage does: on a hybrid host the
// controllers are split between the two and a figure missing from one is
// read as 0 there. A cgroup found in no hierarchy is ErrNotExist.
func ReadStats(mounts []string, cgroupPath string) (Stats, error) {
	var st Stats
	found := false
	known, _ := cachedMounts() // none: every path holds every controller
	for _, m := range mounts {
		d := filepath.Join(m, cgroupPath)
		if d == m {
			continue
		}
		// A v1 hierarchy holds only its controllers' files: on a hybrid
		// host, looking for all of them in all dozen hierarchies would
		// be ~130 lookups per cgroup, most of them failing, on every
		// sample of every sandbox. A path that is not a known mount
		// (a caller's own list) is looked through for all of them.
		has := func(string) bool { return true }
		if i := slices.IndexFunc(known, func(h hierarchy) bool { return h.path == m }); i >= 0 {
			has = known[i].holds
		}
		if _, err := os.Stat(d); err != nil {
			continue
		}
		found = true
		if has("cpuacct") {
			// cgroup v2: cpu.stat's usage_usec exists in every cgroup,
			// with or without the cpu controller.
			if kv := ReadKV(filepath.Join(d, "cpu.stat")); kv != nil {
				st.CPU = max(st.CPU, time.Duration(kv["usage_usec"])*time.Microsecond)
			}
			if n, ok := ReadInt(filepath.Join(d, "cpuacct.usage")); ok {
				st.CPU = max(st.CPU, time.Duration(n))
			}
		}
		if has("memory") {
			for _, f := range []string{"memory.current", "memory.usage_in_bytes"} {
				if n, ok := ReadInt(filepath.Join(d, f)); ok {
					st.Memory = max(st.Memory, n)
				}
			}
			if kv := ReadKV(filepath.Join(d, "memory.stat")); kv != nil {
				// v2: anon and file; v1: total_rss and total_cache (with
				// the cgroups below), else rss and cache.
				st.RSS = max(st.RSS, kv["anon"], kv["total_rss"], kv["rss"])
				st.Cache = max(st.Cache, kv["file"], kv["total_cache"], kv["cache"])
				st.Shmem = max(st.Shmem, kv["shmem"], kv["total_shmem"])
			}
			for _, f := range []string{"memory.max", "memory.limit_in_bytes"} {
				// v2 writes "max" for none (readInt fails); v1 a
				// page-rounded int64 maximum.
				if n, ok := ReadInt(filepath.Join(d, f)); ok && n < 1<<62 {
					if st.MemoryLimit == 0 || n < st.MemoryLimit {
						st.MemoryLimit = n
					}
				}
			}
		}
		if has("pids") {
			if n, ok := ReadInt(filepath.Join(d, "pids.current")); ok {
				st.Pids = max(st.Pids, n)
			}
		}
	}
	if !found {
		return Stats{}, fmt.Errorf("cgroup %s: %w", cgroupPath, fs.ErrNotExist)
	}
	return st, nil
}

// ReadInt reads a control file that holds one integer.
func ReadInt(path string) (int64, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	return n, err == nil
}

// ReadKV reads a "key value" per line control file (cpu.stat,
// memory.stat); nil when it cannot be read.
func ReadKV(path string) map[string]int64 {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil
	}
	out := map[string]int64{}
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(line, " ")
		if !ok {
			continue
		}
		if n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64); err == nil {
			out[k] = n
		}
	}
	return out
}
