// Package nospacetest makes small filesystems for disk-full tests: a
// loop-backed XFS or ext4 image, or a tmpfs with a size, mounted on a
// fresh directory, and a filler that takes all of its free space and gives
// it back. Everything is unmounted and detached when the test ends, also
// when it fails.
package nospacetest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/loopdev"
	"github.com/cubesandbox/cube/internal/testenv"
)

// Mount makes a filesystem of fstype ("xfs", "ext4" or "tmpfs") and
// sizeMiB and returns its mount point. XFS is made with reflink=1 (a
// storage pool on it clones by reflink) and needs at least 300 MiB.
func Mount(t testing.TB, fstype string, sizeMiB int) string {
	t.Helper()
	testenv.RequireRoot(t, "loop devices and mounts")
	// Not t.TempDir: that is private (0700), and a daemon's run dir must
	// be reachable by sandboxes' unprivileged roots.
	base, err := os.MkdirTemp("", "cube-nospace-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(base) }) // last: after unmount and detach
	if err := os.Chmod(base, 0o755); err != nil {
		t.Fatal(err)
	}
	mnt := filepath.Join(base, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	if fstype == "tmpfs" {
		if err := unix.Mount("tmpfs", mnt, "tmpfs", 0, fmt.Sprintf("size=%dm", sizeMiB)); err != nil {
			t.Fatalf("mount tmpfs: %v", err)
		}
		t.Cleanup(func() { unmount(t, mnt) })
		return mnt
	}
	testenv.RequireBinary(t, "mkfs."+fstype, map[string]string{"xfs": "xfsprogs", "ext4": "e2fsprogs"}[fstype])
	img := filepath.Join(base, fstype+".img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, int64(sizeMiB)<<20); err != nil {
		t.Fatal(err)
	}
	args := []string{"-q", img}
	switch fstype {
	case "xfs":
		args = []string{"-q", "-m", "reflink=1", img}
	case "ext4":
		// No blocks kept for root: the daemons run as root and would
		// otherwise write on into a "full" filesystem.
		args = []string{"-q", "-F", "-m", "0", img}
	}
	if out, err := exec.Command("mkfs."+fstype, args...).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.%s: %v: %s", fstype, err, out)
	}
	var dev string
	dev, err = loopdev.Attach(context.Background(), img, false)
	if err != nil {
		t.Fatalf("attach %s: %v", img, err)
	}
	t.Cleanup(func() {
		if err := loopdev.Detach(dev); err != nil {
			t.Errorf("detach %s: %v", dev, err)
		}
	})
	if err := unix.Mount(dev, mnt, fstype, 0, ""); err != nil {
		t.Fatalf("mount %s on %s: %v", dev, mnt, err)
	}
	// Registered after Detach's cleanup, so it runs first.
	t.Cleanup(func() { unmount(t, mnt) })
	return mnt
}

// unmount unmounts mnt, retrying while a closing process still holds it,
// and detaches anything mounted below it first.
func unmount(t testing.TB, mnt string) {
	t.Helper()
	if data, err := os.ReadFile("/proc/self/mountinfo"); err == nil {
		var below []string
		for _, line := range strings.Split(string(data), "\n") {
			f := strings.Fields(line)
			if len(f) > 4 && strings.HasPrefix(f[4], mnt+"/") {
				below = append(below, f[4])
			}
		}
		for i := len(below) - 1; i >= 0; i-- {
			_ = unix.Unmount(below[i], unix.MNT_DETACH)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := unix.Unmount(mnt, 0)
		if err == nil || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("unmount %s: %v; detaching lazily", mnt, err)
			_ = unix.Unmount(mnt, unix.MNT_DETACH)
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Fill takes every free block of the filesystem holding dir with one
// preallocated file (and, where blocks remain that fallocate cannot take,
// small written files) and returns a func that deletes them again. It is
// also deleted when the test ends.
func Fill(t testing.TB, dir string) (free func()) {
	t.Helper()
	return FillLeaving(t, dir, 0)
}

// FillLeaving is Fill that then gives back about leave bytes (a hole
// punched in the filler), so an operation can start writing and run out
// part way.
func FillLeaving(t testing.TB, dir string, leave int64) (free func()) {
	t.Helper()
	fillDir, err := os.MkdirTemp(dir, ".filler-")
	if err != nil {
		t.Fatal(err)
	}
	done := false
	var off int64
	free = func() {
		if done {
			return
		}
		done = true
		before := freeBytes(dir)
		if err := os.RemoveAll(fillDir); err != nil {
			t.Errorf("remove filler: %v", err)
		}
		// XFS frees an unlinked file's blocks in the background (inode
		// inactivation workers), which a loaded machine runs late: sync,
		// then wait until most of the filler's blocks are free again, so
		// the space is back when free returns.
		if d, err := os.Open(dir); err == nil {
			_ = unix.Syncfs(int(d.Fd()))
			d.Close()
		}
		want := before + off*9/10
		deadline := time.Now().Add(30 * time.Second)
		for freeBytes(dir) < want && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if got := freeBytes(dir); got < want {
			t.Errorf("filler removed but only %d bytes free after 30 s, want %d", got, want)
		}
	}
	t.Cleanup(free)
	f, err := os.Create(filepath.Join(fillDir, "big"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for chunk := int64(1 << 30); chunk >= 4096; {
		if err := unix.Fallocate(int(f.Fd()), 0, off, chunk); err != nil {
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatalf("fallocate: %v", err)
			}
			chunk /= 2
			continue
		}
		off += chunk
	}
	// Whatever fallocate could not take in one piece: small files until
	// the filesystem refuses.
	for i := 0; ; i++ {
		err := os.WriteFile(filepath.Join(fillDir, fmt.Sprintf("s%d", i)), make([]byte, 4096), 0o600)
		if err != nil {
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatalf("fill: %v", err)
			}
			break
		}
	}
	if leave > 0 {
		if leave > off {
			t.Fatalf("cannot leave %d bytes: the filler holds %d", leave, off)
		}
		if err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 0, leave); err != nil {
			t.Fatalf("punch %d bytes: %v", leave, err)
		}
	}
	_ = f.Sync()
	return free
}

// FreeBytes is what statfs says an unprivileged writer may still use.
func FreeBytes(t testing.TB, dir string) int64 {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	return int64(st.Bavail) * st.Bsize
}

func freeBytes(dir string) int64 {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0
	}
	return int64(st.Bavail) * st.Bsize
}
