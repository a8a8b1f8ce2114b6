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
// (and with a network slot its sysfs), so a create got slower the fuller
// the node: with 6,000 host mounts a bare `runc run` took ~95 ms more
// (docs/operating-cubelet.md, "Many sandboxes on one node"). Started
// from a copy of this namespace, runc sees a few dozen mounts however
// many sandboxes run.
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
type launchNS struct {
	ns   int // the base namespace (nsfs)
	root int // its root directory (O_PATH): looks paths up in its tree from any thread
	log  *slog.Logger
}

// newLaunchNS builds the base namespace, keeping what keep's paths are on.
func newLaunchNS(keep []string, log *slog.Logger) (*launchNS, error) {
	l := &launchNS{ns: -1, root: -1, log: log}
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
	goruntime.AddCleanup(l, func(fds [2]int) {
		unix.Close(fds[0])
		unix.Close(fds[1])
	}, [2]int{l.ns, l.root})
	return l, nil
}

func (l *launchNS) close() {
	for _, fd := range []int{l.ns, l.root} {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
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
		if err := unix.Unmount(m.Mountpoint, unix.MNT_DETACH); err != nil &&
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

// sameIn reports whether path names the same file on the host as in the
// base namespace (device and inode). A path the base lacks is not the
// same; an error is an error of the host's lookup.
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
	staged []string // files and directories made to mount clones on; removed by close
}

type launchClone struct {
	tree int    // detached copy of the host's mount (open_tree)
	at   string // where it goes in the copy
}

// plan prepares spec's start from a copy of the base namespace: every
// source of spec (root and bind mounts) that is not the same file there
// as on the host is cloned from the host, to go at the same path, or,
// where the base has no such path, at a new entry of stage (which must
// lie on a kept mount and be reachable by the sandbox's root) with spec
// pointing there. infra are paths runc itself uses (its binary, root,
// the bundle): the base must show them as the host does. A nil plan
// means: start runc from the host's namespace (reason says why).
func (l *launchNS) plan(spec *specs.Spec, stage string, infra []string) (p *launchPlan, reason string, err error) {
	for _, path := range infra {
		var st unix.Stat_t
		if err := unix.Stat(path, &st); err != nil {
			return nil, "", fmt.Errorf("runc: %w", err)
		}
		if !l.sameIn(path, &st) {
			return nil, path + " differs in the launch namespace", nil
		}
	}
	p = &launchPlan{l: l}
	defer func() {
		if p == nil || err != nil {
			p.close()
			p = nil
		}
	}()
	sources := []*string{&spec.Root.Path}
	for i := range spec.Mounts {
		if spec.Mounts[i].Type == "bind" {
			sources = append(sources, &spec.Mounts[i].Source)
		}
	}
	for _, src := range sources {
		var st unix.Stat_t
		if err := unix.Stat(*src, &st); err != nil {
			return p, "", fmt.Errorf("runc: %w", err)
		}
		if l.sameIn(*src, &st) {
			continue
		}
		at := *src
		if !l.sameParent(at) {
			if at, err = p.stageEntry(stage, st.Mode&unix.S_IFMT == unix.S_IFDIR); err != nil {
				return p, "", err
			}
		}
		tree, err := unix.OpenTree(unix.AT_FDCWD, *src, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_RECURSIVE)
		if err != nil {
			return p, "", fmt.Errorf("runc: open_tree %s: %w", *src, err)
		}
		p.clones = append(p.clones, launchClone{tree: tree, at: at})
		*src = at
	}
	return p, "", nil
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
// clone on.
func (p *launchPlan) stageEntry(stage string, dir bool) (string, error) {
	if len(p.staged) == 0 {
		if err := os.Mkdir(stage, 0o711); err != nil && !errors.Is(err, os.ErrExist) {
			return "", fmt.Errorf("runc: %w", err)
		}
		p.staged = append(p.staged, stage)
	}
	at := filepath.Join(stage, strconv.Itoa(len(p.staged)))
	var err error
	if dir {
		err = os.Mkdir(at, 0o700)
	} else {
		var f *os.File
		if f, err = os.OpenFile(at, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o400); err == nil {
			err = f.Close()
		}
	}
	if err != nil {
		return "", fmt.Errorf("runc: %w", err)
	}
	p.staged = append(p.staged, at)
	var st unix.Stat_t
	if err := unix.Stat(at, &st); err != nil || !p.l.sameIn(at, &st) {
		return "", fmt.Errorf("runc: %s is not on a mount the launch namespace keeps", stage)
	}
	return at, nil
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
		if err := unix.Unshare(unix.CLONE_FS); err != nil {
			return fmt.Errorf("unshare: %w", err)
		}
		if err := unix.Setns(p.l.ns, unix.CLONE_NEWNS); err != nil {
			return fmt.Errorf("setns launch namespace: %w", err)
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
	for _, s := range slices.Backward(p.staged) {
		_ = os.Remove(s)
	}
	p.clones, p.staged = nil, nil
}

// in runs f (which forks runc) on a throwaway thread in the base
// namespace itself: runc's commands on an existing container (state,
// kill, delete, update) read mountinfo as `runc run` does and need none
// of a sandbox's mounts. On a nil launchNS f runs where it is called.
func (l *launchNS) in(f func() error) error {
	if l == nil {
		return f()
	}
	return onThrowawayThread(func() error {
		if err := unix.Unshare(unix.CLONE_FS); err != nil {
			return fmt.Errorf("unshare: %w", err)
		}
		if err := unix.Setns(l.ns, unix.CLONE_NEWNS); err != nil {
			return fmt.Errorf("setns launch namespace: %w", err)
		}
		return f()
	})
}
