package userns

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/forkthread"
)

// holderTimeout bounds how long NewNamespace waits for its helper to
// create the namespace.
const holderTimeout = 10 * time.Second

// Namespace is an open user namespace. It lives as long as it is open.
type Namespace struct{ fd int }

// startHelper starts NewNamespace's helper (a variable for the test's
// control, which starts it from the calling goroutine's thread).
var startHelper = forkthread.Start

// NewNamespace creates a user namespace that maps container IDs
// 0..r.Size-1 onto r (UIDs and GIDs), is owned by host UID r.HostID, and
// has limits set in its /proc/sys/user (e.g. "max_user_namespaces": 0).
//
// The owner matters: the kernel charges every per-user count made inside
// a namespace (inotify instances and watches, user namespaces, ...) also
// to the namespace's owner in the parent namespace (inc_ucount in
// kernel/ucount.c). Owned by its range's base, a sandbox's usage adds up
// against the host's per-user limits for that UID alone, never against
// host root's.
//
// Only a process can create a namespace, and its owner is that process's
// effective UID: util-linux unshare is started as r.HostID and runs sh in
// a new user namespace. Once the namespace exists its ID maps are written
// from here (host root may map any range); then the shell execs a second
// one, which, now root of the namespace with every capability in it,
// writes the limits (/proc/sys/user shows the writer's namespace), says
// so and waits. The namespace is opened, and the helper is killed and
// reaped before NewNamespace returns, on every path.
func NewNamespace(r Range, limits map[string]int) (*Namespace, error) {
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		return nil, fmt.Errorf("userns: %w", err)
	}
	sh, err := exec.LookPath("sh")
	if err != nil {
		return nil, fmt.Errorf("userns: %w", err)
	}
	own, err := os.Readlink("/proc/self/ns/user")
	if err != nil {
		return nil, fmt.Errorf("userns: %w", err)
	}
	var script strings.Builder
	for _, k := range slices.Sorted(maps.Keys(limits)) {
		if !validLimit(k) {
			return nil, fmt.Errorf("userns: limit %q: %w", k, errdefs.ErrInvalidArgument)
		}
		fmt.Fprintf(&script, "echo %d >/proc/sys/user/%s && ", limits[k], k)
	}
	script.WriteString("echo ok && read _")
	// The first shell's capabilities were computed when the namespace
	// had no maps yet (so it has none); the one it execs after the maps
	// are written is the namespace's root.
	cmd := exec.Command(unshare, "--user", "--", sh, "-c", `read _ && exec "$0" -c "$1"`, sh, script.String())
	cmd.Dir = "/"
	cmd.Env = []string{}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Credential: &syscall.Credential{Uid: r.HostID, Gid: r.HostID, Groups: []uint32{}},
		// The helper also exits by itself when this process dies (its
		// stdin pipe closes); Pdeathsig is the backstop. The kernel sends
		// it when the forking thread ends, so the helper is started from
		// forkthread's thread, which never does: from a thread the Go
		// runtime later hands to a goroutine that locks it and exits
		// (entering a network or UTS namespace does), the helper was
		// killed mid-answer and the create failed "set limits: EOF".
		Pdeathsig: syscall.SIGKILL,
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, fmt.Errorf("userns: %w", err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		stdin.Close()
		return nil, fmt.Errorf("userns: %w", err)
	}
	if err := startHelper(cmd); err != nil {
		stdin.Close()
		return nil, fmt.Errorf("userns: start namespace helper: %w", err)
	}
	defer func() {
		stdin.Close()
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}()
	proc := "/proc/" + strconv.Itoa(cmd.Process.Pid)
	if err := waitUnshared(proc, own); err != nil {
		return nil, err
	}
	m := fmt.Sprintf("0 %d %d\n", r.HostID, r.Size)
	for _, f := range []string{"uid_map", "gid_map"} {
		if err := os.WriteFile(filepath.Join(proc, f), []byte(m), 0); err != nil {
			return nil, fmt.Errorf("userns: write %s: %w", f, err)
		}
	}
	if _, err := io.WriteString(stdin, "go\n"); err != nil {
		return nil, fmt.Errorf("userns: namespace helper: %w", err)
	}
	if err := readOK(stdout); err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return nil, fmt.Errorf("userns: set limits: %w: %s", err, strings.TrimSpace(stderr.String()))
	}
	fd, err := unix.Open(filepath.Join(proc, "ns/user"), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("userns: open namespace: %w", err)
	}
	return &Namespace{fd: fd}, nil
}

// validLimit: a file name of /proc/sys/user.
func validLimit(k string) bool {
	if k == "" {
		return false
	}
	for _, c := range k {
		if (c < 'a' || c > 'z') && c != '_' {
			return false
		}
	}
	return true
}

// readOK reads the helper's "ok" line, bounded by holderTimeout.
func readOK(r io.ReadCloser) error {
	done := make(chan error, 1)
	go func() {
		line, err := bufio.NewReader(r).ReadString('\n')
		if err == nil && line != "ok\n" {
			err = fmt.Errorf("helper said %q", line)
		}
		done <- err
	}()
	select {
	case err := <-done:
		return err
	case <-time.After(holderTimeout):
		return errors.New("namespace helper did not answer in time")
	}
}

// waitUnshared waits until the process at proc is in another user
// namespace than own.
func waitUnshared(proc, own string) error {
	deadline := time.Now().Add(holderTimeout)
	delay := 50 * time.Microsecond
	for {
		ns, err := os.Readlink(filepath.Join(proc, "ns/user"))
		if err != nil {
			return fmt.Errorf("userns: namespace helper: %w", err)
		}
		if ns != own {
			return nil
		}
		if st, err := os.ReadFile(filepath.Join(proc, "stat")); err == nil && isZombie(st) {
			return errors.New("userns: namespace helper exited before unsharing")
		}
		if time.Now().After(deadline) {
			return errors.New("userns: namespace helper did not unshare in time")
		}
		time.Sleep(delay)
		delay = min(delay*2, 2*time.Millisecond)
	}
}

// isZombie reports whether a /proc/<pid>/stat line says the process has
// exited.
func isZombie(stat []byte) bool {
	for i := len(stat) - 1; i > 0; i-- {
		if stat[i] == ')' {
			return i+2 < len(stat) && (stat[i+2] == 'Z' || stat[i+2] == 'X')
		}
	}
	return false
}

// Fd is the namespace's file descriptor.
func (n *Namespace) Fd() int { return n.fd }

// Path names the namespace for another process (runc's namespace path)
// while n is open.
func (n *Namespace) Path() string {
	return fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), n.fd)
}

// OwnerUID is the host UID that owns the namespace.
func (n *Namespace) OwnerUID() (uint32, error) {
	const nsGetOwnerUID = 0xb704 // NS_GET_OWNER_UID, _IO(0xb7, 0x4): writes a uid_t
	uid, err := unix.IoctlGetUint32(n.fd, nsGetOwnerUID)
	if err != nil {
		return 0, fmt.Errorf("userns: NS_GET_OWNER_UID: %w", err)
	}
	return uid, nil
}

// Close releases the namespace (it lives on while a process is in it).
func (n *Namespace) Close() error { return unix.Close(n.fd) }

// MountIDMapped mounts an idmapped view of the mount at src on dst through
// ns: a file owned by ID n on disk appears owned by ns's host ID for n, so
// processes in ns see the on-disk owners unchanged, and files they create
// are stored with container IDs. The view is nodev: device nodes in an
// image are never usable through it.
func MountIDMapped(src, dst string, ns *Namespace) error {
	tree, err := unix.OpenTree(unix.AT_FDCWD, src, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return fmt.Errorf("userns: open_tree %s: %w", src, err)
	}
	defer unix.Close(tree)
	attr := &unix.MountAttr{
		Attr_set:  unix.MOUNT_ATTR_IDMAP | unix.MOUNT_ATTR_NODEV,
		Userns_fd: uint64(ns.fd),
	}
	if err := unix.MountSetattr(tree, "", unix.AT_EMPTY_PATH, attr); err != nil {
		return fmt.Errorf("userns: idmap %s: %w", src, err)
	}
	if err := unix.MoveMount(tree, "", unix.AT_FDCWD, dst, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("userns: move_mount to %s: %w", dst, err)
	}
	return nil
}

// Unmount detaches the mount at dst (lazily: a process still inside
// keeps it alive, but the path is free) and removes the directory. An
// absent dst is not an error.
func Unmount(dst string) error {
	err := unix.Unmount(dst, unix.MNT_DETACH)
	if err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("userns: unmount %s: %w", dst, err)
	}
	if err := os.Remove(dst); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("userns: %w", err)
	}
	return nil
}
