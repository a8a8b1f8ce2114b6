package runc

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/runtime/cgroups"
)

// lateMounts are mounts the driver makes itself in a sandbox's mount
// namespace right after `runc run` returns, instead of asking runc for
// them, because runc would make each a superblock of its own: a tmpfs
// for /dev/shm, a read-only tmpfs over every masked directory under
// /proc (runc refuses any other mount inside /proc, so a bind like those
// under /sys cannot be in the spec), and on a host with cgroup v1
// hierarchies a tmpfs at /sys/fs/cgroup to hold its binds of them. Every
// superblock registers a memcg-aware shrinker, and the kernel keeps a
// slot for each in every memory cgroup, so on a node of N sandboxes each
// superblock per sandbox costs N slots (operating-cubelet.md, "Many
// sandboxes on one node").
//
// Made here, /dev/shm is a directory of the sandbox's /dev tmpfs bound
// onto itself nosuid,nodev,noexec (what runc's tmpfs had; the two share
// /dev's size); a masked /proc directory is a read-only bind of the
// driver's empty directory; /sys/fs/cgroup is a read-only bind of the
// host's /sys/fs/cgroup tmpfs alone (its hierarchies' mount points and
// links, nothing under them), with the sandbox's own cgroup of each
// hierarchy bound read-only at its mount point, as runc binds them (a
// hierarchy runc did not place it in keeps an empty mount point).
// Nothing of the sandbox's runs before them but its agent, which only
// cubelet reaches until the create under way answers: no command of a
// user's sees the sandbox without them.
type lateMounts struct {
	// procDirs are masked directories under /proc, bound to empty.
	procDirs []string
	empty    string
	// shm makes /dev/shm, as owner (the host UID and GID of the
	// sandbox's root).
	shm   bool
	owner int
	// cgroupV1 binds /sys/fs/cgroup and the sandbox's v1 cgroups.
	cgroupV1 bool
	// cgroupPath is the sandbox's cgroup (spec.Linux.CgroupsPath): its
	// init is known by it.
	cgroupPath string
}

func (l lateMounts) none() bool { return len(l.procDirs) == 0 && !l.shm && !l.cgroupV1 }

// isDefaultShm is the /dev/shm entry of ocispec's mounts, which
// lateMounts replaces; any other /dev/shm (a volume) is left to runc.
func isDefaultShm(m specs.Mount) bool {
	return m.Destination == "/dev/shm" && m.Type == "tmpfs" && m.Source == "shm"
}

// deferMounts takes out of spec what lateMounts makes instead: the
// default /dev/shm tmpfs when /dev is a tmpfs and nothing else mounts at
// or under /dev/shm, the cgroup mount where runc would hold the v1
// hierarchies in a tmpfs (cgroupV1Tree) and nothing else mounts under
// /sys/fs/cgroup, and the masked paths under /proc that are directories
// on the host (whose /proc layout the sandbox's shares).
func deferMounts(spec *specs.Spec, empty string) lateMounts {
	l := lateMounts{empty: empty}
	if spec.Linux == nil {
		return l
	}
	l.cgroupPath = path.Clean(spec.Linux.CgroupsPath)
	devTmpfs, others := false, false
	for _, m := range spec.Mounts {
		switch {
		case m.Destination == "/dev" && m.Type == "tmpfs":
			devTmpfs = true
		case (m.Destination == "/dev/shm" || strings.HasPrefix(m.Destination, "/dev/shm/")) && !isDefaultShm(m):
			others = true
		}
	}
	if devTmpfs && !others && slices.ContainsFunc(spec.Mounts, isDefaultShm) {
		spec.Mounts = slices.DeleteFunc(spec.Mounts, isDefaultShm)
		l.shm = true
		for _, m := range spec.Linux.UIDMappings {
			if m.ContainerID == 0 {
				l.owner = int(m.HostID)
			}
		}
	}
	if i := slices.IndexFunc(spec.Mounts, isCgroupMount); i >= 0 && cgroupV1Tree() &&
		!slices.ContainsFunc(spec.Mounts, func(m specs.Mount) bool {
			return !isCgroupMount(m) && (m.Destination == cgroupRoot || strings.HasPrefix(m.Destination, cgroupRoot+"/"))
		}) {
		spec.Mounts = slices.Delete(spec.Mounts, i, i+1)
		l.cgroupV1 = true
	}
	spec.Linux.MaskedPaths = slices.DeleteFunc(spec.Linux.MaskedPaths, func(p string) bool {
		if strings.HasPrefix(p, "/proc/") && isDir(p) {
			l.procDirs = append(l.procDirs, p)
			return true
		}
		return false
	})
	return l
}

// FailpointLateMounts fires in Start after runc has run, before the
// late mounts are made.
const FailpointLateMounts = "runc/late-mounts"

func lateApply(ctx context.Context, l lateMounts, pid int) error {
	if err := failpoint.Eval(ctx, FailpointLateMounts); err != nil {
		return err
	}
	return l.apply(pid)
}

const cgroupRoot = "/sys/fs/cgroup"

func isCgroupMount(m specs.Mount) bool { return m.Destination == cgroupRoot && m.Type == "cgroup" }

// cgroupV1Tree reports whether runc would mount a tmpfs at
// /sys/fs/cgroup (the host's is a tmpfs: cgroup v1 or hybrid) and every
// v1 hierarchy is mounted right under it, where the bind of the host's
// tmpfs has a mount point for it.
func cgroupV1Tree() bool {
	var fs unix.Statfs_t
	if unix.Statfs(cgroupRoot, &fs) != nil || fs.Type != unix.TMPFS_MAGIC {
		return false
	}
	ms, err := cgroups.V1Mounts()
	if err != nil || len(ms) == 0 {
		return false
	}
	return !slices.ContainsFunc(ms, func(m string) bool { return filepath.Dir(m) != cgroupRoot })
}

// inCgroup reports whether a /proc/<pid>/cgroup lists cgroupPath, as a
// whole path or the end of one (cubelet's view of a hierarchy may be a
// subtree of it: V1Mount.Root).
func inCgroup(procCgroup, cgroupPath string) bool {
	for line := range strings.Lines(procCgroup) {
		parts := strings.SplitN(strings.TrimSpace(line), ":", 3)
		// cgroupPath is absolute: a suffix match ends at a whole name.
		if len(parts) == 3 && strings.HasSuffix(parts[2], cgroupPath) {
			return true
		}
	}
	return false
}

// lateBind is a detached mount (cloneMount) and where it goes.
type lateBind struct {
	tree   int
	target string
}

// apply makes the mounts in the mount namespace of pid, the sandbox's
// init, from a thread that joins it and then ends (onThrowawayThread),
// so no thread goes back to the scheduler in another mount namespace.
func (l lateMounts) apply(pid int) error {
	if l.none() {
		return nil
	}
	// The namespace is joined through a pidfd, and the process checked
	// to be in the sandbox's cgroup while the pidfd names it: a PID
	// reused after the sandbox's init exited is refused.
	pidfd, err := unix.PidfdOpen(pid, 0)
	if errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("late mounts: the sandbox's init (pid %d) has exited", pid)
	} else if err != nil {
		return fmt.Errorf("late mounts: pidfd of %d: %w", pid, err)
	}
	defer unix.Close(pidfd)
	own, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cgroup")
	if err != nil {
		return fmt.Errorf("late mounts: cgroups of %d: %w", pid, err)
	}
	if !inCgroup(string(own), l.cgroupPath) {
		return fmt.Errorf("late mounts: pid %d is not in the sandbox's cgroup %s", pid, l.cgroupPath)
	}
	if err := unix.PidfdSendSignal(pidfd, 0, nil, 0); err != nil {
		return fmt.Errorf("late mounts: the sandbox's init (pid %d) has exited: %w", pid, err)
	}

	// What lies outside the sandbox is cloned here, in the host's
	// namespace, and moved into the sandbox's: a bind by name could not
	// reach it there.
	const ro = unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV | unix.MOUNT_ATTR_NOEXEC
	var binds []lateBind
	defer func() {
		for _, b := range binds {
			_ = unix.Close(b.tree)
		}
	}()
	add := func(src, target string) error {
		fd, err := cloneMount(src, ro)
		if err != nil {
			return fmt.Errorf("late mounts: bind %s at %s: %w", src, target, err)
		}
		binds = append(binds, lateBind{fd, target})
		return nil
	}
	for _, p := range l.procDirs {
		if err := add(l.empty, p); err != nil {
			return err
		}
	}
	if l.cgroupV1 {
		// First the host's tmpfs alone (not recursive), then each
		// hierarchy's cgroup of the sandbox onto its mount point there.
		if err := add(cgroupRoot, cgroupRoot); err != nil {
			return err
		}
		n := 0
		for line := range strings.Lines(string(own)) {
			// hierarchy-ID:controllers:path; cgroup2's controllers are empty.
			_, rest, _ := strings.Cut(strings.TrimSpace(line), ":")
			ctrls, cg, ok := strings.Cut(rest, ":")
			if !ok || ctrls == "" {
				continue
			}
			m, ok, err := cgroups.V1MountFor(ctrls)
			if err != nil {
				return fmt.Errorf("late mounts: %w", err)
			}
			rel, under := strings.CutPrefix(cg, strings.TrimSuffix(m.Root, "/"))
			// Only the sandbox's own cgroup: in a hierarchy runc did
			// not place it in, its path is an ancestor, whose tree is
			// other sandboxes' and the host's. Left empty there.
			if !ok || !under || rel != l.cgroupPath {
				continue
			}
			if err := add(filepath.Join(m.Path, rel), filepath.Join(cgroupRoot, filepath.Base(m.Path))); err != nil {
				return err
			}
			n++
		}
		if n == 0 {
			// An empty tree would have the sandbox's runtimes read the
			// host's memory and CPUs as their limits.
			return fmt.Errorf("late mounts: no cgroup v1 hierarchy shows the sandbox's cgroup %s", l.cgroupPath)
		}
	}
	if err := onThrowawayThread(func() error { return l.applyIn(pidfd, binds) }); err != nil {
		return fmt.Errorf("late mounts: %w", err)
	}
	return nil
}

func (l lateMounts) applyIn(pidfd int, binds []lateBind) error {
	// setns into a mount namespace refuses a thread that shares its
	// root and working directory with others, as Go's threads do.
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		return fmt.Errorf("unshare CLONE_FS: %w", err)
	}
	if err := unix.Setns(pidfd, unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("join the mount namespace: %w", err)
	}
	// From here "/" is the sandbox's root.
	for _, b := range binds {
		if err := unix.MoveMount(b.tree, "", unix.AT_FDCWD, b.target, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
			return fmt.Errorf("mount at %s: %w", b.target, err)
		}
	}
	if !l.shm {
		return nil
	}
	const shm = "/dev/shm"
	// As the sandbox's root: /dev's tmpfs belongs to the sandbox's user
	// namespace, which has no inode owner for host root (EOVERFLOW).
	// Only this thread's file system IDs change, and it ends.
	// setfsuid and setfsgid report no failure but by what they leave:
	// read back (-1 changes nothing and returns the current ID).
	_, _ = unix.SetfsgidRetGid(l.owner)
	_, _ = unix.SetfsuidRetUid(l.owner)
	if g, _ := unix.SetfsgidRetGid(-1); g != l.owner {
		return fmt.Errorf("setfsgid %d: still %d", l.owner, g)
	}
	if u, _ := unix.SetfsuidRetUid(-1); u != l.owner {
		return fmt.Errorf("setfsuid %d: still %d", l.owner, u)
	}
	// /dev is the fresh tmpfs runc made; only the agent has run since,
	// and it creates nothing there.
	if err := unix.Mkdir(shm, 0o700); err != nil {
		return fmt.Errorf("mkdir %s: %w", shm, err)
	}
	if err := unix.Chmod(shm, 0o1777); err != nil {
		return fmt.Errorf("chmod %s: %w", shm, err)
	}
	fd, err := cloneMount(shm, unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV|unix.MOUNT_ATTR_NOEXEC)
	if err != nil {
		return fmt.Errorf("bind %s: %w", shm, err)
	}
	defer unix.Close(fd)
	if err := unix.MoveMount(fd, "", unix.AT_FDCWD, shm, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("bind %s: %w", shm, err)
	}
	return nil
}

// cloneMount is a detached bind of path (open_tree OPEN_TREE_CLONE),
// private, with attrs set.
func cloneMount(path string, attrs uint64) (int, error) {
	fd, err := unix.OpenTree(unix.AT_FDCWD, path, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("open_tree: %w", err)
	}
	if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH, &unix.MountAttr{Attr_set: attrs, Propagation: unix.MS_PRIVATE}); err != nil {
		return -1, errors.Join(fmt.Errorf("mount_setattr: %w", err), unix.Close(fd))
	}
	return fd, nil
}
