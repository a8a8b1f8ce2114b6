package fsfreeze

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/storage"
	"github.com/cubesandbox/cube/internal/testenv"
)

// scratchFS loop-mounts a small ext4 image: freezing anything real (the
// host's root) from a test is out of the question.
func scratchFS(t *testing.T) string {
	t.Helper()
	testenv.RequireRoot(t, "loop-mounts a filesystem and freezes it")
	dir := t.TempDir()
	img := filepath.Join(dir, "fs.img")
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", img, "16M").CombinedOutput(); err != nil {
		testenv.Missing(t, "mkfs.ext4: %v: %s", err, out)
	}
	mnt := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := storage.MountDisk(ctx, img, mnt, false); err != nil {
		t.Fatalf("mount: %v", err)
	}
	t.Cleanup(func() {
		// Whatever happened, thaw before unmounting.
		_ = ioctl(mnt, fithaw)
		if err := storage.UnmountDisk(ctx, mnt, img); err != nil {
			t.Errorf("unmount: %v", err)
		}
	})
	return mnt
}

func TestFreezeBlocksWritesUntilThaw(t *testing.T) {
	mnt := scratchFS(t)
	f := &Freezer{Path: mnt}
	until, err := f.Freeze(time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if frozen, u := f.Frozen(); !frozen || !u.Equal(until) {
		t.Fatalf("Frozen() = %v %v", frozen, u)
	}
	if _, err := f.Freeze(time.Minute); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("second freeze: %v", err)
	}
	wrote := make(chan error, 1)
	go func() { wrote <- os.WriteFile(filepath.Join(mnt, "during"), []byte("x"), 0o644) }()
	select {
	case err := <-wrote:
		t.Fatalf("write finished on a frozen filesystem: %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	if err := f.Thaw(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-wrote:
		if err != nil {
			t.Fatalf("write after thaw: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("write still blocked after thaw")
	}
	if err := f.Thaw(); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("thaw of a thawed fs: %v", err)
	}
}

func TestFreezeThawsByItselfAtItsDeadline(t *testing.T) {
	mnt := scratchFS(t)
	f := &Freezer{Path: mnt}
	if _, err := f.Freeze(200 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := os.WriteFile(filepath.Join(mnt, "blocked"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d < 100*time.Millisecond || d > 5*time.Second {
		t.Fatalf("write waited %s, want about the 200ms deadline", d)
	}
	if frozen, _ := f.Frozen(); frozen {
		t.Fatal("still marked frozen after the deadline")
	}
}

func TestFreezeErrors(t *testing.T) {
	f := &Freezer{Path: t.TempDir()}
	for _, d := range []time.Duration{0, -time.Second, MaxTimeout + time.Second} {
		if _, err := f.Freeze(d); !errdefs.IsInvalidArgument(err) {
			t.Errorf("Freeze(%s) = %v, want InvalidArgument", d, err)
		}
	}
	if _, err := (&Freezer{Path: "/nonexistent/mount"}).Freeze(time.Second); err == nil {
		t.Error("freeze of a missing path succeeded")
	}
}
