package loopdev

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/testenv"
)

func requireRoot(t *testing.T) {
	t.Helper()
	testenv.RequireRoot(t, "loop-control ioctls")
	if _, err := os.Stat(controlPath); err != nil {
		t.Skipf("no %s: %v", controlPath, err)
	}
}

func backingFile(t *testing.T, dir, name string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(p, 1<<20); err != nil {
		t.Fatal(err)
	}
	return p
}

// detachAllUnder is the safety net: whatever a failed test left bound to a
// file in dir is unbound.
func detachAllUnder(t *testing.T, dir string) {
	t.Cleanup(func() {
		devs, _ := List()
		for _, d := range devs {
			if filepath.Dir(d.BackingFile) == dir {
				_ = Detach(d.Path)
			}
		}
	})
}

func TestAttachDetach(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	detachAllUnder(t, dir)
	f := backingFile(t, dir, "a.img")

	dev, err := Attach(context.Background(), f, true)
	if err != nil {
		t.Fatal(err)
	}
	found, err := FindByBacking(f)
	if err != nil || len(found) != 1 || found[0].Path != dev {
		t.Fatalf("FindByBacking = %v, %v; want [%s]", found, err, dev)
	}
	if _, err := os.ReadFile(fmt.Sprintf("/sys/block/%s/ro", filepath.Base(dev))); err != nil {
		t.Fatal(err)
	}
	if ro, _ := os.ReadFile(fmt.Sprintf("/sys/block/%s/ro", filepath.Base(dev))); string(ro) != "1\n" {
		t.Errorf("read-only attach: ro = %q", ro)
	}
	if err := Detach(dev); err != nil {
		t.Fatal(err)
	}
	if err := Detach(dev); err != nil {
		t.Fatalf("second Detach: %v", err)
	}
	if err := Detach("/dev/loop-does-not-exist"); err != nil {
		t.Fatalf("Detach of absent device: %v", err)
	}
	waitGone(t, f)
}

func TestAttachMissingFile(t *testing.T) {
	requireRoot(t)
	_, err := Attach(context.Background(), filepath.Join(t.TempDir(), "nope"), false)
	if !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("err = %v, want ErrNotFound", err)
	}
}

func TestAutoclearFreesOnLastClose(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	detachAllUnder(t, dir)
	f := backingFile(t, dir, "auto.img")

	var seen string
	dev, err := AttachAutoclear(context.Background(), f, false, func(dev string) error {
		seen = dev
		if got, _ := FindByBacking(f); len(got) != 1 {
			return fmt.Errorf("device not bound during use: %v", got)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if dev != seen {
		t.Fatalf("dev %s != seen %s", dev, seen)
	}
	waitGone(t, f)

	boom := errors.New("boom")
	if _, err := AttachAutoclear(context.Background(), f, false, func(string) error { return boom }); !errors.Is(err, boom) {
		t.Fatalf("err = %v, want boom", err)
	}
	waitGone(t, f)
}

func TestConcurrentAttach(t *testing.T) {
	requireRoot(t)
	const n = 50
	dir := t.TempDir()
	detachAllUnder(t, dir)
	files := make([]string, n)
	for i := range files {
		files[i] = backingFile(t, dir, fmt.Sprintf("c%02d.img", i))
	}

	devs := make([]string, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { devs[i], errs[i] = Attach(context.Background(), files[i], false) })
	}
	wg.Wait()

	seen := map[string]int{}
	for i := range n {
		if errs[i] != nil {
			t.Errorf("attach %d: %v", i, errs[i])
			continue
		}
		if j, dup := seen[devs[i]]; dup {
			t.Errorf("%s handed to both %d and %d", devs[i], j, i)
		}
		seen[devs[i]] = i
		got, err := FindByBacking(files[i])
		if err != nil || len(got) != 1 || got[0].Path != devs[i] {
			t.Errorf("FindByBacking(%s) = %v, %v; want %s", files[i], got, err, devs[i])
		}
	}
	for i := range n {
		wg.Go(func() {
			if devs[i] != "" {
				if err := Detach(devs[i]); err != nil {
					t.Errorf("detach %s: %v", devs[i], err)
				}
			}
		})
	}
	wg.Wait()
	for _, f := range files {
		waitGone(t, f)
	}
}

func TestAttachHonoursContext(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	detachAllUnder(t, dir)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := Attach(ctx, backingFile(t, dir, "x.img"), false); !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
}

// waitGone allows for the kernel finishing an autoclear/clear after the
// last close returned.
func waitGone(t *testing.T, file string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		got, err := FindByBacking(file)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s still bound: %v", file, got)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestDirectIOCachesNothingUnderTheDevice reads a whole device bound with
// Options.DirectIO and checks that none of the backing file entered the
// page cache; the control binds the same file buffered and sees the read
// cache it, so the probe can tell.
func TestDirectIOCachesNothingUnderTheDevice(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	detachAllUnder(t, dir)
	f := backingFile(t, dir, "dio.img")
	if err := os.WriteFile(f, bytes.Repeat([]byte{0x5a}, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	if probe, err := os.OpenFile(f, os.O_RDONLY|unix.O_DIRECT, 0); err != nil {
		t.Skipf("the temp dir's file system cannot open files O_DIRECT: %v", err)
	} else {
		probe.Close()
	}
	for _, dio := range []bool{false, true} {
		dropCache(t, f)
		opts := Options{DirectIO: dio, BlockSize: 4096}
		var gotDIO bool
		var gotBS uint32
		_, err := AttachAutoclearWith(context.Background(), f, opts, func(dev string) error {
			var err error
			if gotDIO, err = DirectIO(dev); err != nil {
				return err
			}
			if gotBS, err = BlockSize(dev); err != nil {
				return err
			}
			data, err := os.ReadFile(dev)
			if err == nil && !bytes.Equal(data, bytes.Repeat([]byte{0x5a}, 1<<20)) {
				err = fmt.Errorf("read %d bytes through %s, not the file's", len(data), dev)
			}
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		waitGone(t, f)
		cached := cachedPages(t, f)
		t.Logf("direct I/O asked %v: device dio=%v, block size %d; backing file pages cached after reading it all: %d", dio, gotDIO, gotBS, cached)
		if gotBS != 4096 {
			t.Errorf("logical block size %d, want 4096", gotBS)
		}
		if gotDIO != dio {
			t.Errorf("device dio = %v, want %v", gotDIO, dio)
		}
		if dio && cached != 0 {
			t.Errorf("direct I/O: %d pages of the backing file cached, want 0", cached)
		}
		if !dio && cached == 0 {
			t.Error("control: a buffered device cached nothing of its backing file either; the probe cannot tell")
		}
	}
	if _, err := AttachAutoclearWith(context.Background(), f, Options{BlockSize: 3000}, func(string) error { return nil }); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("block size 3000: err = %v, want InvalidArgument", err)
	}
}

// dropCache evicts file from the page cache.
func dropCache(t *testing.T, file string) {
	t.Helper()
	fd, err := unix.Open(file, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Fdatasync(fd); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fadvise(fd, 0, 0, unix.FADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
	if n := cachedPages(t, file); n != 0 {
		t.Fatalf("%d pages of %s still cached after FADV_DONTNEED", n, file)
	}
}

// cachedPages counts the pages of file in the page cache (mincore).
func cachedPages(t *testing.T, file string) int {
	t.Helper()
	fd, err := unix.Open(file, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		t.Fatal(err)
	}
	m, err := unix.Mmap(fd, 0, int(st.Size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = unix.Munmap(m) }()
	vec := make([]byte, (len(m)+os.Getpagesize()-1)/os.Getpagesize())
	if _, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(len(m)), uintptr(unsafe.Pointer(&vec[0]))); errno != 0 {
		t.Fatal(errno)
	}
	n := 0
	for _, v := range vec {
		n += int(v & 1)
	}
	return n
}
