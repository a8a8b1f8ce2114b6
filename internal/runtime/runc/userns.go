package runc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	goruntime "runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/userns"
)

// UserNS configures the user namespace every sandbox runs in. The zero
// value is the production setting.
type UserNS struct {
	// Disabled runs sandboxes as the host's real root, as containers
	// without a user namespace do. Only the tests' control cases set it.
	Disabled bool
	// First and Count are the host IDs handed out: Count blocks of
	// userns.Size IDs from First (userns.DefaultFirst, DefaultCount).
	First uint32
	Count int
	// AllocFile is the host's allocation file (userns.DefaultFile): one
	// per host, whatever the runc root, so two drivers on a host never
	// hand out the same IDs.
	AllocFile string
	// MountDir holds each sandbox's idmapped root filesystem and sysfs:
	// <MountDir>/<id>/{rootfs,sys}, and during a start the entries its
	// launch namespace mounts bind sources on (<id>/launch). Default:
	// Root + "-userns". Every directory above it must be searchable by
	// other users (the sandbox's root is one, on the host), MountDir
	// itself is made 0711 (no listing) and <id> 0700 owned by the
	// sandbox's range.
	MountDir string
	// InotifyInstances and InotifyWatches are the per-user inotify
	// limits set inside every sandbox's namespace (user.max_inotify_*);
	// 0 means 64 and 65536, negative leaves the namespace unlimited (the
	// host's per-user limits for the range's base UID then bound the
	// sandbox: controls only).
	InotifyInstances int
	InotifyWatches   int
	// AllowNested lets code in a sandbox create user namespaces of its
	// own (user.max_user_namespaces is 0 otherwise). Controls only.
	AllowNested bool
}

const (
	// defaultInotifyInstances is per user of a sandbox. The whole sandbox
	// is bounded by the host's per-user limit for its range's base UID
	// (fs.inotify.max_user_instances, 128 by default), since every
	// instance is charged to the namespace's owner too: half of that
	// default, so no single user in a sandbox takes all of it (the agent,
	// root inside, watches directories for the files API).
	defaultInotifyInstances = 64
	defaultInotifyWatches   = 65536
	// oldAllocName is where allocations were kept per runc root; a
	// driver that finds one moves it into the host's file.
	oldAllocName = "cube:userns.json"
)

// usernsState is what the driver keeps for user namespaces.
type usernsState struct {
	cfg   UserNS
	alloc *userns.Allocator
	log   *slog.Logger

	// spare holds fresh, never used namespaces for free blocks, by host
	// ID: creating one (a helper process) is most of what a user
	// namespace adds to a create, so it is done ahead, in the
	// background, and Acquire prefers the blocks that have one.
	spareMu sync.Mutex
	spare   map[uint32]*userns.Namespace
	filling atomic.Bool
}

func newUsernsState(root string, cfg UserNS, log *slog.Logger) (*usernsState, error) {
	if cfg.Disabled {
		return &usernsState{cfg: cfg}, nil
	}
	if cfg.MountDir == "" {
		cfg.MountDir = root + "-userns"
	}
	if cfg.InotifyInstances == 0 {
		cfg.InotifyInstances = defaultInotifyInstances
	}
	if cfg.InotifyWatches == 0 {
		cfg.InotifyWatches = defaultInotifyWatches
	}
	for _, bin := range []string{"unshare", "sh"} {
		if _, err := exec.LookPath(bin); err != nil {
			return nil, fmt.Errorf("runc: user namespaces need %s (util-linux, sh): %w: %w", bin, errdefs.ErrUnavailable, err)
		}
	}
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, fmt.Errorf("runc: %w", err)
	}
	alloc, err := userns.NewAllocator(cfg.AllocFile, abs, cfg.First, cfg.Count)
	if err != nil {
		return nil, err
	}
	if err := alloc.Import(filepath.Join(root, oldAllocName)); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(cfg.MountDir, 0o711); err != nil {
		return nil, fmt.Errorf("runc: %w", err)
	}
	if err := os.Chmod(cfg.MountDir, 0o711); err != nil {
		return nil, fmt.Errorf("runc: %w", err)
	}
	if err := searchableByOthers(cfg.MountDir); err != nil {
		return nil, err
	}
	u := &usernsState{cfg: cfg, alloc: alloc, log: log}
	u.reap(root, log)
	return u, nil
}

// reapGrace is how old a sandbox's mount directory must be before a new
// Driver takes its range back: younger ones may belong to a Start of
// another process sharing the root, between taking the range and runc
// creating its state.
const reapGrace = time.Minute

// reap releases the ranges of sandboxes runc does not know (a process
// that died between taking a range and runc creating the container, or
// before it released one). Sandboxes runc knows are released by Stop,
// which reconcile calls for the ones without a record.
func (u *usernsState) reap(root string, log *slog.Logger) {
	ids, err := u.alloc.IDs()
	if err != nil {
		log.Warn("cannot read user namespace allocations", "error", err)
		return
	}
	for _, id := range ids {
		if _, err := os.Stat(filepath.Join(root, id)); err == nil {
			continue
		}
		if st, err := os.Stat(u.dir(id)); err == nil && time.Since(st.ModTime()) < reapGrace {
			continue
		}
		if err := u.release(context.Background(), id); err != nil {
			log.Warn("cannot release the ID range of a sandbox runc does not know", "id", id, "error", err)
		}
	}
}

// searchableByOthers checks that every directory from / to dir lets
// other users pass: runc's init opens the root filesystem as the
// sandbox's root, an unprivileged host user.
func searchableByOthers(dir string) error {
	for d := dir; ; d = filepath.Dir(d) {
		st, err := os.Stat(d)
		if err != nil {
			return fmt.Errorf("runc: %w", err)
		}
		if st.Mode().Perm()&0o001 == 0 {
			return fmt.Errorf("runc: %s (mode %v) is not searchable by other users, so no sandbox's root could reach %s: %w",
				d, st.Mode().Perm(), dir, errdefs.ErrFailedPrecondition)
		}
		if d == "/" {
			return nil
		}
	}
}

func (u *usernsState) dir(id string) string { return filepath.Join(u.cfg.MountDir, id) }

// prepared is what Start needs from prepare until runc has run.
type prepared struct {
	ns *userns.Namespace // nil without a user namespace
	// netns: run runc with this network namespace as its own, the
	// sandbox inheriting it (see prepare).
	netns string
}

// close drops the namespace fd; runc's processes keep the namespace.
func (p prepared) close() {
	if p.ns != nil {
		_ = p.ns.Close()
	}
}

// prepare gives sandbox s its ID range, user namespace and mounts and
// rewrites spec to use them: runc joins the namespace (its limits already
// set), the idmapped view of s.RootFS is the root, and sysfs comes from
// the sandbox's network namespace.
// On error everything it did is undone.
func (u *usernsState) prepare(ctx context.Context, s runtime.Spec, spec *specs.Spec) (p prepared, err error) {
	if u.cfg.Disabled {
		return prepared{}, nil
	}
	r, err := u.alloc.Acquire(s.ID, u.spareIDs()...)
	if err != nil {
		return prepared{}, err
	}
	defer u.refill()
	defer func() {
		if err != nil {
			p.close()
			err = errors.Join(err, u.release(context.WithoutCancel(ctx), s.ID))
			p = prepared{}
		}
	}()
	dir := u.dir(s.ID)
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return p, fmt.Errorf("runc: %w", err)
	}
	// Owned by the range's root: runc's init passes through it as that
	// user; any other host user is kept out of the sandbox's files.
	if err := os.Chown(dir, int(r.HostID), int(r.HostID)); err != nil {
		return p, fmt.Errorf("runc: %w", err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return p, fmt.Errorf("runc: %w", err)
	}
	// A namespace of its own for every sandbox, never reused: keyrings
	// and other per-namespace state would otherwise pass from one
	// tenant to the next.
	if p.ns, err = u.namespace(r); err != nil {
		return p, err
	}
	rootfs := filepath.Join(dir, "rootfs")
	if err := os.Mkdir(rootfs, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return p, fmt.Errorf("runc: %w", err)
	}
	if err := userns.MountIDMapped(s.RootFS, rootfs, p.ns); err != nil {
		return p, err
	}
	spec.Root.Path = rootfs
	if dropped := dropInheritedRlimits(spec); len(dropped) > 0 {
		u.log.DebugContext(ctx, "rlimits left to inheritance (no CAP_SYS_RESOURCE to set them in a user namespace)", "id", s.ID, "rlimits", dropped)
	}

	// runc joins the namespace rather than creating one: created by runc
	// it would be owned by host root, and every sandbox's per-user counts
	// would add up against root's host limits (userns.NewNamespace).
	m := []specs.LinuxIDMapping{{ContainerID: 0, HostID: r.HostID, Size: r.Size}}
	spec.Linux.UIDMappings, spec.Linux.GIDMappings = m, m
	spec.Linux.Namespaces = append(spec.Linux.Namespaces, specs.LinuxNamespace{Type: specs.UserNamespace, Path: p.ns.Path()})

	if s.NetNSPath != "" {
		if err := u.hostSideNetwork(s, spec, dir); err != nil {
			return p, fmt.Errorf("runc start %s: %w", s.ID, err)
		}
		p.netns = s.NetNSPath
	} else if _, ok := spec.Linux.Sysctl["net.ipv4.ping_group_range"]; ok {
		// runc makes the network namespace inside the user namespace,
		// whose GIDs end at Size-1.
		spec.Linux.Sysctl["net.ipv4.ping_group_range"] = fmt.Sprintf("0 %d", r.Size-1)
	}
	return p, nil
}

// dropInheritedRlimits removes the rlimits a sandbox would inherit from
// runc anyway, when this process lacks CAP_SYS_RESOURCE (cubelet in a
// restricted container). runc sets a container's rlimits with prlimit
// from the host side, which the kernel allows on a process of another
// user only with CAP_SYS_RESOURCE over its user namespace; the sandbox's
// namespace is owned by its range, not by root, so only the host-wide
// capability would do. An entry whose hard limit fitRlimits already
// lowered to ours is what the sandbox inherits (the soft limit inherited
// is at most as high), so dropping it loosens nothing; lower limits
// stay and make runc fail loudly rather than be lost.
func dropInheritedRlimits(sp *specs.Spec) (dropped []string) {
	if sp.Process == nil || hasCap(capSysResource) {
		return nil
	}
	sp.Process.Rlimits = slices.DeleteFunc(sp.Process.Rlimits, func(rl specs.POSIXRlimit) bool {
		res, ok := rlimitResources[rl.Type]
		if !ok {
			return false
		}
		var cur unix.Rlimit
		if unix.Getrlimit(res, &cur) != nil || rl.Hard != cur.Max {
			return false
		}
		dropped = append(dropped, rl.Type)
		return true
	})
	return dropped
}

// hostSideNetwork adapts spec to a network namespace made in the host's
// user namespace (the network agent's). runc joins the user namespace
// before any other, and from inside it may not join a network namespace
// the host owns (setns: EPERM); so the namespace leaves the spec and
// Start runs runc inside it, the sandbox inheriting it. For the same
// reason the sandbox could neither mount a sysfs of it (the kernel refuses
// sysfs to a user namespace that does not own the network namespace) nor
// write its sysctls: both happen here, on an OS thread switched into the
// namespace, and sysfs is bound read-only at /sys.
func (u *usernsState) hostSideNetwork(s runtime.Spec, spec *specs.Spec, dir string) error {
	spec.Linux.Namespaces = slices.DeleteFunc(spec.Linux.Namespaces, func(n specs.LinuxNamespace) bool {
		return n.Type == specs.NetworkNamespace
	})
	sysctls := map[string]string{}
	for k, v := range spec.Linux.Sysctl {
		if strings.HasPrefix(k, "net.") {
			sysctls[k] = v
			delete(spec.Linux.Sysctl, k)
		}
	}
	sys := filepath.Join(dir, "sys")
	if err := os.Mkdir(sys, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	if err := inNetNS(s.NetNSPath, func() error {
		if err := unix.Mount("sysfs", sys, "sysfs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
			return fmt.Errorf("mount sysfs: %w", err)
		}
		// Values as the host's user namespace reads them: GIDs are host
		// GIDs here (ping_group_range "0 2147483647" covers every range).
		for k, v := range sysctls {
			file := filepath.Join("/proc/sys", strings.ReplaceAll(k, ".", "/"))
			if err := os.WriteFile(file, []byte(v), 0); err != nil {
				return fmt.Errorf("sysctl %s: %w", k, err)
			}
		}
		return nil
	}); err != nil {
		return err
	}
	for i, mnt := range spec.Mounts {
		if mnt.Destination == "/sys" && mnt.Type == "sysfs" {
			spec.Mounts[i] = specs.Mount{Destination: "/sys", Type: "bind", Source: sys,
				Options: []string{"rbind", "ro", "nosuid", "nodev", "noexec"}}
		}
	}
	return nil
}

const spareCount = 2

// spareIDs lists the blocks that have a spare namespace.
func (u *usernsState) spareIDs() []uint32 {
	u.spareMu.Lock()
	defer u.spareMu.Unlock()
	return slices.Sorted(maps.Keys(u.spare))
}

// namespace returns r's spare namespace, or a new one.
func (u *usernsState) namespace(r userns.Range) (*userns.Namespace, error) {
	u.spareMu.Lock()
	ns := u.spare[r.HostID]
	delete(u.spare, r.HostID)
	u.spareMu.Unlock()
	if ns != nil {
		return ns, nil
	}
	return userns.NewNamespace(r, u.limits())
}

// refill tops the spares up to spareCount free blocks in the background
// (one refill at a time). A spare whose block another process took is
// closed: it was never used, but it is not needed either.
func (u *usernsState) refill() {
	if !u.filling.CompareAndSwap(false, true) {
		return
	}
	go func() {
		defer u.filling.Store(false)
		free, err := u.alloc.Free(spareCount + len(u.spareIDs()))
		if err != nil {
			u.log.Warn("cannot list free ID ranges", "error", err)
			return
		}
		isFree := map[uint32]bool{}
		for _, r := range free {
			isFree[r.HostID] = true
		}
		u.spareMu.Lock()
		for h, ns := range u.spare {
			if !isFree[h] {
				_ = ns.Close()
				delete(u.spare, h)
			}
		}
		have := len(u.spare)
		u.spareMu.Unlock()
		for _, r := range free {
			if have >= spareCount {
				return
			}
			u.spareMu.Lock()
			_, ok := u.spare[r.HostID]
			u.spareMu.Unlock()
			if ok {
				continue
			}
			ns, err := userns.NewNamespace(r, u.limits())
			if err != nil {
				u.log.Warn("cannot create a spare user namespace", "error", err)
				return
			}
			u.spareMu.Lock()
			if u.spare == nil {
				u.spare = map[uint32]*userns.Namespace{}
			}
			u.spare[r.HostID] = ns
			u.spareMu.Unlock()
			have++
		}
	}()
}

// limits are the namespace's /proc/sys/user settings, written by
// userns.NewNamespace as the namespace's root before runc starts: the
// sandbox's code never runs without them.
func (u *usernsState) limits() map[string]int {
	l := map[string]int{}
	if u.cfg.InotifyInstances > 0 {
		l["max_inotify_instances"] = u.cfg.InotifyInstances
	}
	if u.cfg.InotifyWatches > 0 {
		l["max_inotify_watches"] = u.cfg.InotifyWatches
	}
	if !u.cfg.AllowNested {
		l["max_user_namespaces"] = 0
	}
	return l
}

// release unmounts what prepare mounted for id and frees its range. It is
// a no-op for an id without either.
func (u *usernsState) release(ctx context.Context, id string) error {
	if u.cfg.Disabled {
		return nil
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	dir := u.dir(id)
	var errs []error
	for _, m := range []string{filepath.Join(dir, "sys"), filepath.Join(dir, "rootfs")} {
		errs = append(errs, userns.Unmount(m))
	}
	// The empty directory bound over masked directories (bindMaskedDirs).
	if err := os.Remove(filepath.Join(dir, "masked")); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("runc: %w", err))
	}
	// Entries a start mounted clones on in its launch namespace, left by a
	// process that died during it; nothing is mounted on them here.
	if err := os.RemoveAll(filepath.Join(dir, "launch")); err != nil {
		errs = append(errs, fmt.Errorf("runc: %w", err))
	}
	if err := os.Remove(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("runc: %w", err))
	}
	if err := errors.Join(errs...); err != nil {
		return err // the range stays taken while its mounts may exist
	}
	return u.alloc.Release(id)
}

// inNetNS runs fn on an OS thread switched into the network namespace at
// path. The thread is thrown away if it cannot be switched back.
func inNetNS(path string, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		goruntime.LockOSThread()
		errc <- func() error {
			orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err != nil {
				goruntime.UnlockOSThread()
				return err
			}
			defer unix.Close(orig)
			ns, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err != nil {
				goruntime.UnlockOSThread()
				return err
			}
			defer unix.Close(ns)
			if err := unix.Setns(ns, unix.CLONE_NEWNET); err != nil {
				goruntime.UnlockOSThread()
				return fmt.Errorf("setns %s: %w", path, err)
			}
			ferr := fn()
			if err := unix.Setns(orig, unix.CLONE_NEWNET); err != nil {
				return errors.Join(ferr, err) // still locked: the thread exits with us
			}
			goruntime.UnlockOSThread()
			return ferr
		}()
	}()
	return <-errc
}
