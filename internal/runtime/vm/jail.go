package vm

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	goruntime "runtime"
	"strings"
	"syscall"

	"github.com/cubesandbox/cube/internal/errdefs"

	"golang.org/x/sys/unix"
)

// QEMU never runs as root. The driver re-executes its own binary
// (/proc/self/exe) as the jail helper, in a new mount, IPC and UTS
// namespace (and a new, empty network namespace when the VM has no NIC).
// The helper, still root, joins the slot's network namespace, opens the
// TAP and vhost devices QEMU needs, builds the jail (a tmpfs holding
// read-only binds of QEMU, its libraries and firmware and the guest
// kernel, plus /dev/null and /dev/urandom), pivots into it, drops every
// capability (bounding set included), switches to the VM's own uid and
// gid with no supplementary groups, sets no_new_privs and execs QEMU.
// Every other file QEMU uses (disk, console, QMP and agent sockets,
// migration streams) is an open descriptor the driver passes in.
//
// A helper, not os/exec's SysProcAttr alone: SysProcAttr can chroot and
// set credentials, but it cannot mount (the jail is assembled inside the
// new namespace, so no per-VM mount ever appears on the host), setns,
// open the TAP inside the slot's namespace or set no_new_privs before
// exec. The helper is the driver's own binary, so there is nothing extra
// to install; it is selected by argv[0] in an init function and is done
// (exec'd into QEMU) before main runs.

// jailArg0 is argv[0] of the helper; argv[1] is its jailSpec as JSON.
const jailArg0 = "cube-vm-jail"

// jailExitCode is the helper's exit status when it fails before QEMU
// runs; its reason is on stderr (qemu.log).
const jailExitCode = 121

func init() {
	if len(os.Args) == 2 && os.Args[0] == jailArg0 {
		jailMain(os.Args[1])
	}
}

// jailSpec is what the helper does before it becomes QEMU.
type jailSpec struct {
	Dir    string     `json:"dir"` // empty host dir the jail's tmpfs is mounted on
	UID    uint32     `json:"uid"`
	GID    uint32     `json:"gid"`
	Binds  []jailBind `json:"binds"`
	Nodes  []jailNode `json:"nodes"`
	NetNS  int        `json:"netns"` // inherited fd of the netns to join; -1 for none
	Tap    string     `json:"tap"`   // TAP to attach (in NetNS), placed at TapFD
	TapFD  int        `json:"tap_fd"`
	Opens  []jailOpen `json:"opens"` // host devices opened before the jail
	Exec   string     `json:"exec"`  // QEMU's path inside the jail
	Argv   []string   `json:"argv"`
	Groups []uint32   `json:"groups,omitempty"`
	// Proc mounts a procfs at /proc that shows QEMU's own uid's processes
	// only (hidepid=invisible, subset=pid: no sysctls, no host-wide
	// files): how QEMU opens the RAM file it inherited (template.go).
	Proc bool `json:"proc,omitempty"`
	// Env is QEMU's environment (empty unless a test sets qemuTCGEnv).
	Env []string `json:"env,omitempty"`
	// NoTHP turns transparent huge pages off for QEMU
	// (PR_SET_THP_DISABLE, kept across exec): see qemuNoTHP.
	NoTHP bool `json:"no_thp,omitempty"`
}

// jailBind is a read-only bind of host path From at To inside the jail.
type jailBind struct {
	From string `json:"from"`
	To   string `json:"to"`
}

// jailNode is a character device created inside the jail; Own gives it
// to the VM's uid (its /dev/kvm), others are root's.
type jailNode struct {
	Path         string `json:"path"`
	Major, Minor uint32
	Mode         uint32 `json:"mode"`
	Own          bool   `json:"own,omitempty"`
}

// jailOpen is a host device the helper opens read-write and passes to
// QEMU at FD (vhost-net, vhost-vsock).
type jailOpen struct {
	Path string `json:"path"`
	FD   int    `json:"fd"`
}

func jailMain(arg string) {
	// Namespace and credential calls below act on the calling thread or
	// must all happen on the one that execs.
	goruntime.LockOSThread()
	var s jailSpec
	err := json.Unmarshal([]byte(arg), &s)
	if err == nil {
		err = s.enter()
	}
	if err == nil && s.NoTHP {
		if err = unix.Prctl(unix.PR_SET_THP_DISABLE, 1, 0, 0, 0); err != nil {
			err = fmt.Errorf("thp_disable: %w", err)
		}
	}
	if err == nil {
		env := s.Env
		if env == nil {
			env = []string{}
		}
		err = fmt.Errorf("exec %s: %w", s.Exec, unix.Exec(s.Exec, s.Argv, env))
	}
	fmt.Fprintf(os.Stderr, "%s: %v\n", jailArg0, err)
	os.Exit(jailExitCode)
}

func (s *jailSpec) enter() error {
	// Nothing mounted from here on may propagate to the host.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	if s.NetNS >= 0 {
		if err := unix.Setns(s.NetNS, unix.CLONE_NEWNET); err != nil {
			return fmt.Errorf("join network namespace: %w", err)
		}
		_ = unix.Close(s.NetNS)
	}
	if s.Tap != "" {
		fd, err := openTap(s.Tap)
		if err != nil {
			return err
		}
		if err := placeFD(fd, s.TapFD); err != nil {
			return fmt.Errorf("tap: %w", err)
		}
	}
	for _, o := range s.Opens {
		fd, err := unix.Open(o.Path, unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open %s: %w", o.Path, err)
		}
		if err := placeFD(fd, o.FD); err != nil {
			return fmt.Errorf("%s: %w", o.Path, err)
		}
	}
	if err := s.build(); err != nil {
		return err
	}
	if err := pivotInto(s.Dir); err != nil {
		return err
	}
	return dropPrivileges(s.UID, s.GID, s.Groups)
}

// openTap attaches to the existing TAP name in the current network
// namespace, with the flags QEMU itself would use (vnet headers for
// offloads; no packet info).
func openTap(name string) (int, error) {
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open /dev/net/tun: %w", err)
	}
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		_ = unix.Close(fd)
		return -1, err
	}
	ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		_ = unix.Close(fd)
		return -1, fmt.Errorf("attach tap %s: %w", name, err)
	}
	return fd, nil
}

// placeFD moves fd to number want, inheritable across exec.
func placeFD(fd, want int) error {
	if fd == want {
		_, err := unix.FcntlInt(uintptr(fd), unix.F_SETFD, 0)
		return err
	}
	if err := unix.Dup3(fd, want, 0); err != nil {
		return err
	}
	return unix.Close(fd)
}

// build mounts the jail's tmpfs on s.Dir and fills it.
func (s *jailSpec) build() error {
	// nosuid, noexec: nothing on the tmpfs itself runs (QEMU and its
	// libraries are binds); devices stay usable for the nodes made here.
	if err := unix.Mount("tmpfs", s.Dir, "tmpfs", unix.MS_NOSUID|unix.MS_NOEXEC, "mode=0755,size=64k,nr_inodes=1024"); err != nil {
		return fmt.Errorf("mount jail tmpfs on %s: %w", s.Dir, err)
	}
	unix.Umask(0)
	for _, b := range s.Binds {
		dst := filepath.Join(s.Dir, b.To)
		fi, err := os.Stat(b.From)
		if err != nil {
			return fmt.Errorf("jail bind: %w", err)
		}
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return fmt.Errorf("jail bind: %w", err)
		}
		if fi.IsDir() {
			err = unix.Mkdir(dst, 0o755)
		} else {
			var fd int
			fd, err = unix.Open(dst, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_CLOEXEC, 0o444)
			if err == nil {
				_ = unix.Close(fd)
			}
		}
		if err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("jail bind target %s: %w", b.To, err)
		}
		if err := unix.Mount(b.From, dst, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind %s at %s: %w", b.From, b.To, err)
		}
	}
	for _, n := range s.Nodes {
		dst := filepath.Join(s.Dir, n.Path)
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return fmt.Errorf("jail node: %w", err)
		}
		if err := unix.Mknod(dst, unix.S_IFCHR|n.Mode, int(unix.Mkdev(n.Major, n.Minor))); err != nil {
			return fmt.Errorf("mknod %s: %w", n.Path, err)
		}
		if n.Own {
			if err := unix.Chown(dst, int(s.UID), int(s.GID)); err != nil {
				return fmt.Errorf("chown %s: %w", n.Path, err)
			}
		}
	}
	if s.Proc {
		dst := filepath.Join(s.Dir, "proc")
		if err := unix.Mkdir(dst, 0o555); err != nil {
			return fmt.Errorf("jail proc: %w", err)
		}
		if err := unix.Mount("proc", dst, "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "hidepid=invisible,subset=pid"); err != nil {
			return fmt.Errorf("mount jail proc: %w", err)
		}
	}
	// The whole tree, binds included, read-only and nosuid in one call.
	attr := &unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID}
	if err := unix.MountSetattr(unix.AT_FDCWD, s.Dir, unix.AT_RECURSIVE, attr); err != nil {
		return fmt.Errorf("make jail read-only: %w", err)
	}
	return nil
}

// pivotInto makes dir the root and drops every other mount (runc's
// pivot_root(".", ".") then detach of the old root stacked on it).
func pivotInto(dir string) error {
	if err := unix.Chdir(dir); err != nil {
		return err
	}
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root %s: %w", dir, err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach old root: %w", err)
	}
	return unix.Chdir("/")
}

// dropPrivileges empties the capability bounding set, takes uid/gid
// (which clears the effective, permitted and ambient sets) and sets
// no_new_privs, so nothing QEMU could exec gains anything back.
func dropPrivileges(uid, gid uint32, groups []uint32) error {
	for c := 0; ; c++ {
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil {
			if errors.Is(err, unix.EINVAL) && c > 0 {
				break // past the kernel's last capability
			}
			return fmt.Errorf("drop capability %d from the bounding set: %w", c, err)
		}
	}
	gs := make([]int, len(groups))
	for i, g := range groups {
		gs[i] = int(g)
	}
	// syscall's (not unix's) credential calls change every thread.
	if err := syscall.Setgroups(gs); err != nil {
		return fmt.Errorf("setgroups: %w", err)
	}
	if err := syscall.Setresgid(int(gid), int(gid), int(gid)); err != nil {
		return fmt.Errorf("setresgid %d: %w", gid, err)
	}
	if err := syscall.Setresuid(int(uid), int(uid), int(uid)); err != nil {
		return fmt.Errorf("setresuid %d: %w", uid, err)
	}
	var hdr = unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData // inheritable too: nothing left anywhere
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("no_new_privs: %w", err)
	}
	return nil
}

// Where the guest kernel and initrd appear inside the jail.
const (
	jailKernel = "/guest/vmlinuz"
	jailInitrd = "/guest/initrd.img"
)

// qemuFiles is what every jail binds read-only: QEMU's binary, the
// shared libraries and dynamic loader ldd reports for it and its TCG
// accelerator modules (Debian builds TCG as a module), the loader cache,
// and QEMU's firmware directory (microvm's qboot). QEMU finds modules and
// firmware relative to its binary, so all keep their host paths.
func qemuFiles(qemu string) ([]jailBind, error) {
	resolved, err := filepath.EvalSymlinks(qemu)
	if err != nil {
		return nil, fmt.Errorf("vm jail: %w", err)
	}
	seen := map[string]bool{}
	var out []jailBind
	add := func(from, to string) error {
		if seen[to] {
			return nil
		}
		src, err := filepath.EvalSymlinks(from)
		if err != nil {
			return fmt.Errorf("vm jail: %w", err)
		}
		seen[to] = true
		out = append(out, jailBind{From: src, To: to})
		return nil
	}
	if err := add(resolved, resolved); err != nil {
		return nil, err
	}
	prefix := filepath.Dir(filepath.Dir(resolved))
	mods, _ := filepath.Glob(filepath.Join(prefix, "lib", "*", "qemu", "accel-*.so"))
	more, _ := filepath.Glob(filepath.Join(prefix, "lib*", "qemu", "accel-*.so"))
	mods = append(mods, more...)
	for _, bin := range append([]string{resolved}, mods...) {
		libs, err := ldd(bin)
		if err != nil {
			return nil, err
		}
		for _, l := range libs {
			if err := add(l, l); err != nil {
				return nil, err
			}
		}
	}
	for _, m := range mods {
		if err := add(m, m); err != nil {
			return nil, err
		}
	}
	for _, f := range []string{"/etc/ld.so.cache", filepath.Join(prefix, "share", "qemu")} {
		if _, err := os.Stat(f); err == nil {
			if err := add(f, f); err != nil {
				return nil, err
			}
		}
	}
	return out, nil
}

// ldd lists the absolute paths of bin's shared libraries and loader.
func ldd(bin string) ([]string, error) {
	b, err := exec.Command("ldd", bin).Output()
	if err != nil {
		return nil, fmt.Errorf("vm jail: ldd %s: %w: %w", bin, errdefs.ErrUnavailable, err)
	}
	var libs []string
	for _, line := range strings.Split(string(b), "\n") {
		for _, f := range strings.Fields(line) {
			if strings.HasPrefix(f, "/") {
				libs = append(libs, f)
				break
			}
		}
	}
	return libs, nil
}

// charDev reads a host device's numbers, for a node of it in the jail.
func charDev(path string) (major, minor uint32, err error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, 0, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFCHR {
		return 0, 0, fmt.Errorf("%s is not a character device", path)
	}
	return unix.Major(st.Rdev), unix.Minor(st.Rdev), nil
}
