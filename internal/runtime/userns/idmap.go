package userns

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// Mapper makes idmapped mounts. It keeps one user namespace fd per Range
// it has mapped (at most one per block: a few KiB of kernel memory each),
// because creating a namespace costs a process start (~4 ms) and blocks
// are handed out lowest-first, so most sandboxes reuse a recent block.
// Its zero value is ready; it is safe for concurrent use.
type Mapper struct {
	mu  sync.Mutex
	fds map[Range]int
}

// Mount is MountIDMapped with r's namespace from m's cache.
func (m *Mapper) Mount(src, dst string, r Range) error {
	nsfd, err := m.nsFd(r)
	if err != nil {
		return err
	}
	return mountIDMapped(src, dst, nsfd)
}

func (m *Mapper) nsFd(r Range) (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if fd, ok := m.fds[r]; ok {
		return fd, nil
	}
	fd, err := userNSFd(r)
	if err != nil {
		return -1, err
	}
	if m.fds == nil {
		m.fds = map[Range]int{}
	}
	m.fds[r] = fd
	return fd, nil
}

// MountIDMapped mounts an idmapped view of the mount at src on dst: a
// file owned by ID n on disk appears owned by r.HostID+n, so processes in
// a user namespace with r's mapping see the on-disk owners unchanged, and
// files they create are stored with container IDs. The view is nodev:
// device nodes in an image are never usable through it.
//
// The kernel takes the mapping from a user namespace fd, and only a
// process can create one: a short-lived child is started in a new user
// namespace with r's mapping, its namespace is opened, and the child is
// killed and reaped before MountIDMapped returns, on every path.
func MountIDMapped(src, dst string, r Range) error {
	nsfd, err := userNSFd(r)
	if err != nil {
		return err
	}
	defer unix.Close(nsfd)
	return mountIDMapped(src, dst, nsfd)
}

func mountIDMapped(src, dst string, nsfd int) error {
	tree, err := unix.OpenTree(unix.AT_FDCWD, src, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return fmt.Errorf("userns: open_tree %s: %w", src, err)
	}
	defer unix.Close(tree)
	attr := &unix.MountAttr{
		Attr_set:  unix.MOUNT_ATTR_IDMAP | unix.MOUNT_ATTR_NODEV,
		Userns_fd: uint64(nsfd),
	}
	if err := unix.MountSetattr(tree, "", unix.AT_EMPTY_PATH, attr); err != nil {
		return fmt.Errorf("userns: idmap %s: %w", src, err)
	}
	if err := unix.MoveMount(tree, "", unix.AT_FDCWD, dst, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("userns: move_mount to %s: %w", dst, err)
	}
	return nil
}

// userNSFd returns an fd of a new user namespace mapping 0..r.Size-1 to
// r for both UIDs and GIDs. The namespace lives as long as the fd.
func userNSFd(r Range) (int, error) {
	cat, err := exec.LookPath("cat")
	if err != nil {
		return -1, fmt.Errorf("userns: %w", err)
	}
	m := []syscall.SysProcIDMap{{ContainerID: 0, HostID: int(r.HostID), Size: int(r.Size)}}
	// cat blocks on its stdin until we close it, and exits by itself if
	// this process dies first (the pipe closes); Pdeathsig is the backstop.
	cmd := exec.Command(cat)
	cmd.Dir = "/"
	cmd.Env = []string{}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  syscall.CLONE_NEWUSER,
		UidMappings: m,
		GidMappings: m,
		Pdeathsig:   syscall.SIGKILL,
	}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return -1, fmt.Errorf("userns: %w", err)
	}
	if err := cmd.Start(); err != nil {
		stdin.Close()
		return -1, fmt.Errorf("userns: start namespace holder: %w", err)
	}
	fd, oerr := unix.Open(fmt.Sprintf("/proc/%d/ns/user", cmd.Process.Pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	stdin.Close()
	_ = cmd.Process.Kill()
	werr := cmd.Wait()
	if oerr != nil {
		return -1, fmt.Errorf("userns: open namespace of holder: %w", oerr)
	}
	var ee *exec.ExitError
	if werr != nil && !errors.As(werr, &ee) {
		unix.Close(fd)
		return -1, fmt.Errorf("userns: reap namespace holder: %w", werr)
	}
	return fd, nil
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
