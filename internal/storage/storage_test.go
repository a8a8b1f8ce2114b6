package storage

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/loopdev"
	"github.com/cubesandbox/cube/internal/testenv"
)

const testPoolSize = 512 << 20 // XFS needs at least 300 MiB

func requireRoot(t *testing.T) {
	t.Helper()
	testenv.RequireRoot(t, "loop devices, mounts")
}

// openTestPool opens a pool under a fresh temp dir and guarantees it is
// unmounted and its loop device gone when the test ends.
func openTestPool(t *testing.T, cfg PoolConfig) *Pool {
	t.Helper()
	if cfg.Dir == "" {
		cfg.Dir = filepath.Join(t.TempDir(), "pool")
	}
	if cfg.ImageSizeBytes == 0 {
		cfg.ImageSizeBytes = testPoolSize
	}
	p, err := OpenPool(context.Background(), cfg)
	if err != nil {
		t.Fatalf("OpenPool: %v", err)
	}
	t.Cleanup(func() {
		if err := p.Teardown(context.Background()); err != nil {
			t.Errorf("Teardown: %v", err)
		}
		assertNoLoop(t, p.image)
	})
	return p
}

func assertNoLoop(t *testing.T, image string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		devs, err := loopdev.FindByBacking(image)
		if err != nil {
			t.Fatal(err)
		}
		if len(devs) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("loop devices still backed by %s: %v", image, devs)
			for _, d := range devs {
				_ = loopdev.Detach(d.Path)
			}
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func writeFile(t *testing.T, path string, data []byte) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
}

func freeBytes(t *testing.T, dir string) int64 {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	return int64(st.Bavail) * st.Bsize
}

func TestPoolReflinkLoopCloneAndRestart(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	dir := filepath.Join(t.TempDir(), "pool")
	p := openTestPool(t, PoolConfig{Dir: dir})
	if p.Mode() != ModeReflinkLoop && p.Mode() != ModeReflink {
		t.Fatalf("mode = %q", p.Mode())
	}
	if p.Mode() == ModeReflinkLoop {
		if m, _ := IsMounted(dir); !m {
			t.Fatalf("%s not mounted in mode %s", dir, p.Mode())
		}
	}

	data := bytes.Repeat([]byte("cube-template-"), 32<<20/14)
	src := p.TemplateImagePath("tpl1")
	writeFile(t, src, data)
	free := freeBytes(t, dir)
	dst := p.SandboxDiskPath("sb1")
	if err := p.Clone(ctx, src, dst); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(dst); !bytes.Equal(got, data) {
		t.Fatal("clone content differs")
	}
	if used := free - freeBytes(t, dir); used > 4<<20 {
		t.Errorf("reflink clone of %d bytes consumed %d bytes", len(data), used)
	}
	if err := p.Clone(ctx, src, dst); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Errorf("clone onto existing: %v, want ErrAlreadyExists", err)
	}
	if err := p.Clone(ctx, filepath.Join(dir, "missing"), p.SandboxDiskPath("sb2")); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("clone of missing: %v, want ErrNotFound", err)
	}
	if _, err := os.Stat(p.SandboxDiskPath("sb2")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("failed clone left %s behind", p.SandboxDiskPath("sb2"))
	}
	outside := filepath.Join(t.TempDir(), "outside.img")
	if err := p.Clone(ctx, src, outside); err == nil && p.Mode() == ModeReflinkLoop {
		t.Errorf("clone across filesystems succeeded")
	} else if _, serr := os.Stat(outside); err != nil && !errors.Is(serr, os.ErrNotExist) {
		t.Errorf("failed cross-fs clone left %s behind", outside)
	}

	// Reopening while mounted adopts the mount.
	p2, err := OpenPool(ctx, PoolConfig{Dir: dir})
	if err != nil || p2.Mode() != p.Mode() {
		t.Fatalf("reopen mounted pool: mode %v, err %v", p2, err)
	}
	if p.Mode() != ModeReflinkLoop {
		return
	}
	// Restart path: the image is there but nothing is mounted.
	if err := p.Teardown(ctx); err != nil {
		t.Fatal(err)
	}
	assertNoLoop(t, p.image)
	p3, err := OpenPool(ctx, PoolConfig{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	if p3.Mode() != ModeReflinkLoop {
		t.Fatalf("restart mode = %q", p3.Mode())
	}
	if got, _ := os.ReadFile(dst); !bytes.Equal(got, data) {
		t.Fatal("clone lost across remount")
	}
	if err := p3.RemoveSandboxDisk("sb1"); err != nil {
		t.Fatal(err)
	}
	if err := p3.RemoveSandboxDisk("sb1"); err != nil {
		t.Fatalf("second RemoveSandboxDisk: %v", err)
	}
	if err := p3.RemoveSandboxDisk("../templates"); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("RemoveSandboxDisk(../templates) = %v", err)
	}
	if err := p3.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestPoolCopyMode(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	dir := filepath.Join(t.TempDir(), "pool")
	// An image path that cannot be created rules out reflink-loop.
	bad := "/proc/cube-test-no-such-dir/pool.img"
	if _, err := OpenPool(ctx, PoolConfig{Dir: dir, ImagePath: bad}); err != nil {
		if !errors.Is(err, errdefs.ErrFailedPrecondition) {
			t.Fatalf("without AllowCopy: %v, want ErrFailedPrecondition", err)
		}
	} else {
		t.Skip("temp dir supports reflink natively; copy mode not reachable")
	}
	p := openTestPool(t, PoolConfig{Dir: dir, ImagePath: bad, AllowCopy: true})
	if p.Mode() != ModeCopy {
		t.Fatalf("mode = %q", p.Mode())
	}

	// 64 MiB apparent, 2 small data extents.
	src := p.TemplateImagePath("tpl")
	writeFile(t, src, nil)
	f, err := os.OpenFile(src, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, off := range []int64{0, 40 << 20} {
		if _, err := f.WriteAt(bytes.Repeat([]byte{0xab}, 1<<20), off); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Truncate(64 << 20); err != nil {
		t.Fatal(err)
	}
	f.Close()

	dst := p.SandboxDiskPath("sb")
	if err := p.Clone(ctx, src, dst); err != nil {
		t.Fatal(err)
	}
	a, _ := os.ReadFile(src)
	b, _ := os.ReadFile(dst)
	if !bytes.Equal(a, b) {
		t.Fatal("copy differs")
	}
	if used, err := SpaceUsed(dst); err != nil || used > 8<<20 {
		t.Errorf("sparse copy uses %d bytes (err %v), want ~2 MiB", used, err)
	}
	if _, err := SpaceUsed(filepath.Join(dir, "nope")); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("SpaceUsed(missing) = %v", err)
	}
}

// makeExt4 builds a small ext4 image holding hello.txt.
func makeExt4(t *testing.T, dir string) string {
	t.Helper()
	content := filepath.Join(dir, "content")
	writeFile(t, filepath.Join(content, "hello.txt"), []byte("hello cube\n"))
	img := filepath.Join(dir, "disk.img")
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-d", content, img, "16M").CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v: %s", err, out)
	}
	return img
}

func TestMountDisk(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	dir := t.TempDir()
	img := makeExt4(t, dir)
	target := filepath.Join(dir, "run", "sb", "rootfs")
	t.Cleanup(func() {
		_ = UnmountDisk(context.Background(), target, img)
		assertNoLoop(t, img)
	})

	dev, err := MountDisk(ctx, img, target, true)
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := loopdev.FindByBacking(img); len(got) != 1 || got[0].Path != dev {
		t.Fatalf("FindByBacking = %v, want %s", got, dev)
	}
	if m, err := IsMounted(target); err != nil || !m {
		t.Fatalf("IsMounted = %v, %v", m, err)
	}
	if b, _ := os.ReadFile(filepath.Join(target, "hello.txt")); string(b) != "hello cube\n" {
		t.Fatalf("hello.txt = %q", b)
	}
	if err := os.WriteFile(filepath.Join(target, "x"), nil, 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("write to read-only mount: %v, want EROFS", err)
	}
	if _, err := MountDisk(ctx, img, target, true); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Errorf("double mount: %v, want ErrAlreadyExists", err)
	}
	if err := UnmountDisk(ctx, target, img); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(target); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("target not removed: %v", err)
	}
	assertNoLoop(t, img)
	if err := UnmountDisk(ctx, target, img); err != nil {
		t.Fatalf("second UnmountDisk: %v", err)
	}
	if m, err := IsMounted(target); err != nil || m {
		t.Fatalf("IsMounted(gone) = %v, %v", m, err)
	}
}

func TestUnmountDiskBusyFallsBackToLazy(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	dir := t.TempDir()
	img := makeExt4(t, dir)
	target := filepath.Join(dir, "rootfs")
	t.Cleanup(func() {
		_ = UnmountDisk(context.Background(), target, img)
		assertNoLoop(t, img)
	})
	if _, err := MountDisk(ctx, img, target, false); err != nil {
		t.Fatal(err)
	}
	busy, err := os.Open(filepath.Join(target, "hello.txt"))
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	if err := UnmountDisk(ctx, target, img); err != nil {
		t.Fatal(err)
	}
	if m, _ := IsMounted(target); m {
		t.Fatal("still mounted after lazy unmount")
	}
	busy.Close()
	assertNoLoop(t, img)
}

func TestMountDiskFailureCleansUp(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	dir := t.TempDir()
	garbage := filepath.Join(dir, "garbage.img")
	writeFile(t, garbage, bytes.Repeat([]byte{0x5a}, 4<<20))
	target := filepath.Join(dir, "mnt")
	t.Cleanup(func() {
		_ = UnmountDisk(context.Background(), target, garbage)
		assertNoLoop(t, garbage)
	})
	if _, err := MountDisk(ctx, garbage, target, false); err == nil {
		t.Fatal("mounting garbage succeeded")
	}
	if _, err := os.Stat(target); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("failed mount left target: %v", err)
	}
	assertNoLoop(t, garbage)
	if _, err := MountDisk(ctx, filepath.Join(dir, "missing.img"), target, false); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("missing image: %v, want ErrNotFound", err)
	}
}

// TestMountDiskDirectIO checks how MountDiskWith binds a disk: direct I/O
// (where the temp dir's file system allows it) in logical blocks of the
// file system's own size, so 1 KiB-block images still mount, and data
// written through the mount survives a remount.
func TestMountDiskDirectIO(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	for _, bs := range []int{1024, 4096} {
		dir := t.TempDir()
		content := filepath.Join(dir, "content")
		writeFile(t, filepath.Join(content, "hello.txt"), []byte("hello cube\n"))
		img := filepath.Join(dir, "disk.img")
		if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-b", strconv.Itoa(bs), "-d", content, img, "16M").CombinedOutput(); err != nil {
			t.Fatalf("mkfs.ext4: %v: %s", err, out)
		}
		target := filepath.Join(dir, "rootfs")
		t.Cleanup(func() { _ = UnmountDisk(context.Background(), target, img) })
		for round := range 2 {
			dev, err := MountDiskWith(ctx, img, target, DiskOptions{DirectIO: true})
			if err != nil {
				t.Fatalf("%d-byte blocks: %v", bs, err)
			}
			dio, err := loopdev.DirectIO(dev)
			if err != nil {
				t.Fatal(err)
			}
			got, err := loopdev.BlockSize(dev)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("ext4 %d-byte blocks, round %d: %s dio=%v logical block %d", bs, round, dev, dio, got)
			if int(got) != bs {
				t.Errorf("logical block size %d, want the file system's %d", got, bs)
			}
			if !dio {
				if probe, err := os.OpenFile(img, os.O_RDONLY|unix.O_DIRECT, 0); err == nil {
					probe.Close()
					t.Errorf("the image opens O_DIRECT, yet the device is buffered")
				}
			}
			p := filepath.Join(target, "written")
			if round == 0 {
				writeFile(t, p, []byte("through direct I/O\n"))
			} else if b, err := os.ReadFile(p); string(b) != "through direct I/O\n" {
				t.Errorf("after remount: %q, %v", b, err)
			}
			if err := UnmountDisk(ctx, target, img); err != nil {
				t.Fatal(err)
			}
		}
	}
}
