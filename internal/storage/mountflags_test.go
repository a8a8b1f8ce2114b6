package storage

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/loopdev"
	"github.com/cubesandbox/cube/internal/testenv"
)

// nobody is the host account the probes run as: any unprivileged user.
const nobody = 65534

// planted is what a sandbox's root can leave in a filesystem the host
// mounts: a setuid-root copy of id(1) and a character device node (1:3,
// the null device, world-writable).
type planted struct{ setuid, device string }

func plant(t *testing.T, dir string) planted {
	t.Helper()
	p := planted{setuid: filepath.Join(dir, "suid-id"), device: filepath.Join(dir, "planted-dev")}
	id, err := os.ReadFile(testenv.RequireBinary(t, "id", "coreutils"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p.setuid, id, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(p.setuid, 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := unix.Chmod(p.setuid, 0o4755); err != nil { // os.Chmod drops a raw 04000
		t.Fatal(err)
	}
	if err := unix.Mknod(p.device, unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(p.device, 0o666); err != nil { // umask
		t.Fatal(err)
	}
	return p
}

// probe uses what was planted under dir from the host: the effective uid
// the setuid binary gets when nobody runs it ("" if it cannot run), and
// the error opening the device node.
func probe(t *testing.T, dir string) (euid string, execErr, devErr error) {
	t.Helper()
	cmd := exec.Command(filepath.Join(dir, "suid-id"), "-u")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
	out, execErr := cmd.Output()
	f, devErr := os.OpenFile(filepath.Join(dir, "planted-dev"), os.O_WRONLY, 0)
	if devErr == nil {
		_ = f.Close()
	}
	return strings.TrimSpace(string(out)), execErr, devErr
}

// publicDir is a scratch directory every account can traverse (t.TempDir
// is 0700 under a 0700 parent), so a probe as nobody is about the mount
// flags alone. Registered first, it is removed last, after the unmounts.
func publicDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "cube-mountflags-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// mountControl mounts dev again on a fresh directory with no flags: the
// same filesystem, the same planted files, only the flags differ.
func mountControl(t *testing.T, parent, dev, fstype string) string {
	t.Helper()
	ctl := filepath.Join(parent, "control")
	if err := os.Mkdir(ctl, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(dev, ctl, fstype, 0, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(ctl, 0); err != nil {
			t.Errorf("unmount control: %v", err)
		}
	})
	return ctl
}

// TestDiskMountNoSuidNoDev: a setuid binary and a device node planted in
// a sandbox disk are used from the host by nobody through the mount
// MountDisk made: the binary runs (the rootfs is not noexec) but does not
// elevate (nosuid), and the node cannot be opened (nodev). Control: the
// same filesystem mounted without the flags elevates nobody to root and
// opens the node.
func TestDiskMountNoSuidNoDev(t *testing.T) {
	requireRoot(t)
	dir := publicDir(t)
	img := makeExt4(t, dir)
	target := filepath.Join(dir, "rootfs")
	t.Cleanup(func() {
		_ = UnmountDisk(context.Background(), target, img)
		assertNoLoop(t, img)
	})
	dev, err := MountDisk(context.Background(), img, target, false)
	if err != nil {
		t.Fatal(err)
	}
	plant(t, target)

	euid, execErr, devErr := probe(t, target)
	t.Logf("through MountDisk's mount: setuid-root id -u as nobody = %q (%v); open planted 1:3 node: %v", euid, execErr, devErr)
	if execErr != nil || euid != "65534" {
		t.Errorf("setuid binary on the disk mount: euid %q, err %v; want it to run as 65534 (stopped by nosuid)", euid, execErr)
	}
	if !errors.Is(devErr, unix.EACCES) {
		t.Errorf("device node on the disk mount opened: %v; want EACCES (stopped by nodev)", devErr)
	}

	ctl := mountControl(t, dir, dev, "ext4")
	euid, execErr, devErr = probe(t, ctl)
	t.Logf("control, same disk mounted without flags: id -u = %q (%v); open node: %v", euid, execErr, devErr)
	if execErr != nil || euid != "0" {
		t.Errorf("control: setuid binary did not elevate: %q %v", euid, execErr)
	}
	if devErr != nil {
		t.Errorf("control: device node: %v", devErr)
	}
}

// TestPoolMountFlags: the loop-backed pool is mounted nosuid, nodev and
// noexec: what is planted in it neither runs, elevates, nor opens.
// Control: the same filesystem mounted without flags runs the binary as
// root and opens the node.
func TestPoolMountFlags(t *testing.T) {
	requireRoot(t)
	parent := publicDir(t)
	dir := filepath.Join(parent, "pool")
	p := openTestPool(t, PoolConfig{Dir: dir})
	if p.Mode() != ModeReflinkLoop {
		t.Skipf("pool mode %s: no pool mount of ours on this host", p.Mode())
	}
	check := func(when string) {
		t.Helper()
		var st unix.Statfs_t
		if err := unix.Statfs(dir, &st); err != nil {
			t.Fatal(err)
		}
		const want = unix.ST_NOSUID | unix.ST_NODEV | unix.ST_NOEXEC
		if st.Flags&want != want {
			t.Errorf("%s: pool mount flags %#x, want nosuid,nodev,noexec (%#x)", when, st.Flags, want)
		}
	}
	check("opened")
	if err := os.Chmod(dir, 0o755); err != nil { // sealed 0700; loosened so the probe is about the flags alone
		t.Fatal(err)
	}
	plant(t, dir)
	euid, execErr, devErr := probe(t, dir)
	t.Logf("pool mount: setuid id -u as nobody = %q (%v); open node: %v", euid, execErr, devErr)
	if !errors.Is(execErr, unix.EACCES) && !errors.Is(execErr, os.ErrPermission) {
		t.Errorf("binary in the pool ran: %q %v; want EACCES (noexec)", euid, execErr)
	}
	if !errors.Is(devErr, unix.EACCES) {
		t.Errorf("device node in the pool opened: %v; want EACCES (nodev)", devErr)
	}
	devs, err := loopdev.FindByBacking(p.image)
	if err != nil || len(devs) != 1 {
		t.Fatalf("pool loop device: %v %v", devs, err)
	}
	ctl := mountControl(t, parent, devs[0].Path, "xfs")
	euid, execErr, devErr = probe(t, ctl)
	t.Logf("control, pool filesystem without flags: id -u = %q (%v); open node: %v", euid, execErr, devErr)
	if execErr != nil || euid != "0" || devErr != nil {
		t.Errorf("control: %q %v %v; want euid 0 and the node open", euid, execErr, devErr)
	}

	// A pool mounted by an earlier cubelet (older flags) is adopted with
	// the flags set again.
	if err := unix.Mount("", dir, "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_NOATIME, ""); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenPool(context.Background(), PoolConfig{Dir: dir}); err != nil {
		t.Fatal(err)
	}
	check("adopted")
}
