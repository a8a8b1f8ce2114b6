package runc

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	goruntime "runtime"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/moby/sys/mountinfo"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// launchNS is the mount namespace runc starts containers from: a private
// copy of the host's with only the mounts runc itself needs, none of the
// sandboxes'.
//
// `runc run` copies the mount namespace it starts in into the
// container's, makes every mount in it a slave, reads its mountinfo
// several times (cgroup v1 hierarchies, /proc checks) and detaches the
// old root after pivot_root: all of it in proportion to the mounts there.
// On the host, every running sandbox adds its disk and its idmapped view
// (and with a network slot its sysfs): with 6,000 host mounts a bare
// `runc run` takes ~95 ms more than with 20 (docs/operating-cubelet.md,
// "Many sandboxes on one node"). Started from a copy of this namespace,
// runc sees a few dozen mounts however many sandboxes run.
//
// The base namespace keeps the chain of mounts down to each of a few
// paths (the runc binary, runc's root, the sandboxes' mount directory)
// and every mount under /proc, /sys and /dev; everything else is
// detached, so it pins nothing of the host's: not a sandbox's disk (whose
// loop device is freed only once no namespace holds its file system), not
// a network namespace bound on a file, not another program's volumes.
// Later mounts on the host never reach it (it is private). Each Start
// makes a fresh copy of it on a throwaway thread, clones into that copy
// the mounts of the sandbox's own sources (its root, sysfs, host mounts,
// volumes) that the base lacks, and runs runc there; the copy goes with
// the thread.
//
// The kept paths are checked before every use (device and inode, host
// against base): a base that no longer shows them as the host does (a
// mount replaced on the host since) is dropped for good, with a warning,
// and every runc command runs in this process's namespace from then on,
// so Start and Stop never look at two different runc roots.
type launchNS struct {
	ns      int // the base namespace (nsfs)
	root    int // its root directory (O_PATH): looks paths up in its tree from any thread
	keep    []string
	log     *slog.Logger
	stale   atomic.Bool
	cleanup goruntime.Cleanup
}

// newLaunchNS builds the base namespace, keeping what keep's paths are on.
func newLaunchNS(keep []string, log *slog.Logger) (*launchNS, error) {
	l := &launchNS{ns: -1, root: -1, keep: keep, log: log}
	err := onThrowawayThread(func() error {
		if err := unix.Unshare(unix.CLONE_FS | unix.CLONE_NEWNS); err != nil {
			return fmt.Errorf("unshare: %w", err)
		}
		if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
			return fmt.Errorf("make private: %w", err)
		}
		if err := trimMounts(keep); err != nil {
			return err
		}
		var err error
		if l.ns, err = unix.Open("/proc/thread-self/ns/mnt", unix.O_RDONLY|unix.O_CLOEXEC, 0); err != nil {
			return err
		}
		l.root, err = unix.Open("/", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		return err
	})
	if err != nil {
		l.close()
		return nil, fmt.Errorf("runc: launch namespace: %w", err)
	}
	l.cleanup = goruntime.AddCleanup(l, func(fds [2]int) {
		unix.Close(fds[0])
		unix.Close(fds[1])
	}, [2]int{l.ns, l.root})
	return l, nil
}

func (l *launchNS) close() {
	l.cleanup.Stop()
	for _, fd := range []int{l.ns, l.root} {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
	l.ns, l.root = -1, -1
}

// usable reports whether the base still shows the kept paths as the host
// does, and drops it for good (logging why) the first time it does not.
func (l *launchNS) usable() bool {
	if l == nil || l.stale.Load() {
		return false
	}
	for _, p := range l.keep {
		var st unix.Stat_t
		if unix.Stat(p, &st) == nil && l.sameIn(p, &st) {
			continue
		}
		if l.stale.CompareAndSwap(false, true) {
			l.log.Warn("runc runs in this process's mount namespace from now on: the launch namespace no longer shows a kept path as the host does",
				"path", p)
		}
		return false
	}
	return true
}

// keptSubtrees are kept whole: runc and the kernel interfaces it uses
// live there (cgroup hierarchies, /dev/null, /proc/<pid>/ns/user).
var keptSubtrees = []string{"/proc", "/sys", "/dev"}

// trimMounts detaches, in the calling thread's mount namespace, every
// mount but those on the way to keep's paths and those under
// keptSubtrees.
func trimMounts(keep []string) error {
	ms, err := threadMounts()
	if err != nil {
		return err
	}
	byID := make(map[int]*mountinfo.Info, len(ms))
	for _, m := range ms {
		byID[m.ID] = m
	}
	kept := map[int]bool{}
	for _, p := range keep {
		id, err := mountID(p)
		if err != nil {
			return err
		}
		for m := byID[id]; m != nil && !kept[m.ID]; m = byID[m.Parent] {
			kept[m.ID] = true
		}
	}
	for _, p := range keptSubtrees {
		id, err := mountID(p)
		if err != nil {
			continue // a host without it has nothing there to keep
		}
		for m := byID[id]; m != nil && !kept[m.ID]; m = byID[m.Parent] {
			kept[m.ID] = true
		}
		for _, m := range ms {
			if m.Mountpoint == p || strings.HasPrefix(m.Mountpoint, p+"/") {
				kept[m.ID] = true
			}
		}
	}
	// Newest first: a mount is listed after its parent, and one mounted
	// over another after the one it hides, so each path names the mount
	// meant when its turn comes.
	for _, m := range slices.Backward(ms) {
		if kept[m.ID] {
			continue
		}
		if err := unix.Unmount(m.Mountpoint, unix.MNT_DETACH|unix.UMOUNT_NOFOLLOW); err != nil &&
			!errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("detach %s: %w", m.Mountpoint, err)
		}
	}
	left, err := threadMounts()
	if err != nil {
		return err
	}
	for _, m := range left {
		if !kept[m.ID] {
			return fmt.Errorf("mount %s (%s) is still there after its detach", m.Mountpoint, m.FSType)
		}
		delete(kept, m.ID)
	}
	if len(kept) > 0 {
		return fmt.Errorf("%d mounts meant to be kept are gone", len(kept))
	}
	return nil
}

func threadMounts() ([]*mountinfo.Info, error) {
	f, err := os.Open("/proc/thread-self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return mountinfo.GetMountsFromReader(f, nil)
}

// mountID is the ID of the mount path is on, as this thread sees it.
func mountID(path string) (int, error) {
	var st unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, path, 0, unix.STATX_MNT_ID, &st); err != nil {
		return 0, fmt.Errorf("statx %s: %w", path, err)
	}
	if st.Mask&unix.STATX_MNT_ID == 0 {
		return 0, fmt.Errorf("statx %s: no mount ID", path)
	}
	return int(st.Mnt_id), nil
}

// sameIn reports whether path names the same file in the base namespace
// as host does on the host (device and inode). A path the base lacks is
// not the same.
func (l *launchNS) sameIn(path string, host *unix.Stat_t) bool {
	fd, err := unix.Openat2(l.root, strings.TrimPrefix(filepath.Clean(path), "/"), &unix.OpenHow{
		Flags:   unix.O_PATH | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS,
	})
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil {
		return false
	}
	return st.Dev == host.Dev && st.Ino == host.Ino
}

// launchPlan is what one Start clones into its copy of the base.
type launchPlan struct {
	l      *launchNS
	clones []launchClone
	fds    []int    // namespaces the spec names through this process's fds
	staged []string // files and directories made to mount clones on; removed by close
}

type launchClone struct {
	tree int    // detached copy of the host's mount (open_tree)
	at   string // where it goes in the copy
}

// plan prepares spec's start from a copy of the base namespace. Every
// directory spec binds (its root among them) is cloned from the host, with
// its submounts and flags as the host has them; a file only when the base
// does not show the same one. A clone goes at the source's own path or,
// where the base lacks its directory, at a new entry of stage (which must
// lie on a kept mount and be reachable by the sandbox's root) with spec
// pointing there. A namespace spec joins by a path the base does not show
// as the host does is named by an open descriptor instead. infra are
// paths runc itself uses (the bundle): the base must show them as the
// host does. A nil plan means: start runc from this process's namespace
// (reason says why).
func (l *launchNS) plan(spec *specs.Spec, stage string, infra []string) (p *launchPlan, reason string, err error) {
	if !l.usable() {
		return nil, "the launch namespace is stale", nil
	}
	for _, path := range infra {
		var st unix.Stat_t
		if err := unix.Stat(path, &st); err != nil {
			return nil, "", fmt.Errorf("runc: %w", err)
		}
		if !l.sameIn(path, &st) {
			return nil, path + " differs in the launch namespace", nil
		}
	}
	// Entries a start that died left behind: nothing is mounted on them
	// here (they are mount points in launch copies only).
	if err := os.RemoveAll(stage); err != nil {
		return nil, "", fmt.Errorf("runc: %w", err)
	}
	p = &launchPlan{l: l}
	defer func() {
		if p == nil || err != nil || reason != "" {
			p.close()
			p = nil
		}
	}()
	sources := []*string{&spec.Root.Path}
	for i := range spec.Mounts {
		if isBind(spec.Mounts[i]) {
			sources = append(sources, &spec.Mounts[i].Source)
		}
	}
	placed := map[string]string{} // host source -> where its clone goes
	for _, src := range sources {
		if at, ok := placed[*src]; ok {
			*src = at
			continue
		}
		var st unix.Stat_t
		if err := unix.Stat(*src, &st); err != nil {
			return p, "", fmt.Errorf("runc: %w", err)
		}
		isDir := st.Mode&unix.S_IFMT == unix.S_IFDIR
		if !isDir && l.sameIn(*src, &st) {
			placed[*src] = *src
			continue
		}
		at := *src
		if !l.sameParent(at) {
			var ok bool
			if at, ok, err = p.stageEntry(stage, isDir); err != nil || !ok {
				return p, stage + " is not on a mount the launch namespace keeps", err
			}
		}
		tree, err := unix.OpenTree(unix.AT_FDCWD, *src, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_RECURSIVE)
		if err != nil {
			return p, "", fmt.Errorf("runc: open_tree %s: %w", *src, err)
		}
		p.clones = append(p.clones, launchClone{tree: tree, at: at})
		placed[*src] = at
		*src = at
	}
	if spec.Linux != nil {
		for i, ns := range spec.Linux.Namespaces {
			if ns.Path == "" || strings.HasPrefix(ns.Path, "/proc/") {
				continue
			}
			var st unix.Stat_t
			if err := unix.Stat(ns.Path, &st); err != nil {
				return p, "", fmt.Errorf("runc: %w", err)
			}
			if l.sameIn(ns.Path, &st) {
				continue
			}
			fd, err := unix.Open(ns.Path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err != nil {
				return p, "", fmt.Errorf("runc: %w", err)
			}
			p.fds = append(p.fds, fd)
			spec.Linux.Namespaces[i].Path = fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), fd)
		}
	}
	return p, "", nil
}

// isBind reports whether runc binds m (type "bind", or any type with a
// bind option).
func isBind(m specs.Mount) bool {
	return m.Type == "bind" || slices.Contains(m.Options, "bind") || slices.Contains(m.Options, "rbind")
}

// sameParent reports whether path's directory is the same in the base as
// on the host, so that a clone can go at path itself.
func (l *launchNS) sameParent(path string) bool {
	var st unix.Stat_t
	if unix.Stat(filepath.Dir(path), &st) != nil {
		return false
	}
	return l.sameIn(filepath.Dir(path), &st)
}

// stageEntry makes an empty directory or file under stage to mount a
// clone on; ok is false when the base does not show it.
func (p *launchPlan) stageEntry(stage string, dir bool) (at string, ok bool, err error) {
	if len(p.staged) == 0 {
		if err := os.Mkdir(stage, 0o711); err != nil {
			return "", false, fmt.Errorf("runc: %w", err)
		}
		p.staged = append(p.staged, stage)
		// Whatever the umask: the sandbox's root passes through it.
		if err := os.Chmod(stage, 0o711); err != nil {
			return "", false, fmt.Errorf("runc: %w", err)
		}
	}
	at = filepath.Join(stage, strconv.Itoa(len(p.staged)))
	if dir {
		err = os.Mkdir(at, 0o700)
	} else {
		var f *os.File
		if f, err = os.OpenFile(at, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o400); err == nil {
			err = f.Close()
		}
	}
	if err != nil {
		return "", false, fmt.Errorf("runc: %w", err)
	}
	p.staged = append(p.staged, at)
	var st unix.Stat_t
	if err := unix.Stat(at, &st); err != nil {
		return "", false, fmt.Errorf("runc: %w", err)
	}
	return at, p.l.sameIn(at, &st), nil
}

// run runs start (which forks runc) on a throwaway thread in a fresh copy
// of the base namespace with the plan's clones mounted, and in the
// network namespace at netns when it is not "".
func (p *launchPlan) run(netns string, start func() error) error {
	netfd := -1
	if netns != "" {
		var err error
		if netfd, err = unix.Open(netns, unix.O_RDONLY|unix.O_CLOEXEC, 0); err != nil {
			return fmt.Errorf("open %s: %w", netns, err)
		}
		defer unix.Close(netfd)
	}
	return onThrowawayThread(func() error {
		if err := p.l.enter(); err != nil {
			return err
		}
		if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
			return fmt.Errorf("unshare: %w", err)
		}
		for _, c := range p.clones {
			if err := unix.MoveMount(c.tree, "", unix.AT_FDCWD, c.at, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
				return fmt.Errorf("move_mount to %s: %w", c.at, err)
			}
		}
		if netfd >= 0 {
			if err := unix.Setns(netfd, unix.CLONE_NEWNET); err != nil {
				return fmt.Errorf("setns %s: %w", netns, err)
			}
		}
		return start()
	})
}

// close drops the clones and removes the staged entries: runc's
// container holds copies of what it mounted from them.
func (p *launchPlan) close() {
	if p == nil {
		return
	}
	for _, c := range p.clones {
		unix.Close(c.tree)
	}
	for _, fd := range p.fds {
		unix.Close(fd)
	}
	for _, s := range slices.Backward(p.staged) {
		_ = os.Remove(s)
	}
	p.clones, p.fds, p.staged = nil, nil, nil
}

// in runs f (which forks runc) on a throwaway thread in the base
// namespace itself: runc's commands on an existing container (state,
// kill, delete, update, list, pause, resume) read mountinfo as `runc run`
// does and need none of a sandbox's mounts. On a nil or stale launchNS f
// runs where it is called.
func (l *launchNS) in(f func() error) error {
	if !l.usable() {
		return f()
	}
	return onThrowawayThread(func() error {
		if err := l.enter(); err != nil {
			return err
		}
		return f()
	})
}

// enter moves the calling thread, which must be a throwaway one, into the
// base namespace (a thread that shares its filesystem context with the
// process may not change mount namespace).
func (l *launchNS) enter() error {
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		return fmt.Errorf("unshare: %w", err)
	}
	if err := unix.Setns(l.ns, unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("setns launch namespace: %w", err)
	}
	return nil
}
