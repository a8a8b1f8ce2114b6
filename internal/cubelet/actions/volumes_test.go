package actions

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet/config"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/storage"
	"github.com/cubesandbox/cube/internal/testenv"
)

// TestVolumes drives a node's volumes on a real pool: the image is made
// on first mount and its size is the limit (a write past it is ENOSPC, a
// smaller one the control), one sandbox holds a volume at a time (another
// volume is the control), a volume in use is not deleted, a sandbox that
// starts again finds its own mount, what one sandbox wrote the next one
// reads, and a mount that fails leaves no image, mount or owner file.
func TestVolumes(t *testing.T) {
	testenv.RequireRoot(t, "loop devices, mounts")
	testenv.RequireBinary(t, "mkfs.ext4", "e2fsprogs")
	ctx := context.Background()
	dir := t.TempDir()
	cfg, err := config.Parse(nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Node.RunDir, cfg.Node.DataDir = filepath.Join(dir, "run"), filepath.Join(dir, "data")
	pool, err := storage.OpenPool(ctx, storage.PoolConfig{Dir: filepath.Join(dir, "pool"), ImageSizeBytes: 512 << 20})
	if err != nil {
		t.Fatal(err)
	}
	n := &Node{Cfg: cfg, Pool: pool}
	recA := &sandbox.Record{ID: "sba", Volumes: []sandbox.Volume{{ID: "vol1", Path: "/data", SizeMiB: 8}}}
	recB := &sandbox.Record{ID: "sbb", Volumes: []sandbox.Volume{{ID: "vol1", Path: "/data", SizeMiB: 8}}}
	t.Cleanup(func() {
		for _, r := range []*sandbox.Record{recA, recB} {
			_ = n.UnmountVolumes(ctx, r)
		}
		_ = storage.UnmountDisk(ctx, n.VolumeDir("vol2"), pool.VolumeImagePath("vol2"))
		if err := pool.Teardown(ctx); err != nil {
			t.Errorf("pool teardown: %v", err)
		}
	})

	start := time.Now()
	ms, err := n.MountVolumes(ctx, recA)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("first mount (mkfs.ext4 of an 8 MiB image, loop mount): %s", time.Since(start).Round(time.Microsecond))
	if len(ms) != 1 || ms[0].Source != n.VolumeDir("vol1") || ms[0].Destination != "/data" {
		t.Fatalf("mounts %+v", ms)
	}
	st, err := os.Stat(pool.VolumeImagePath("vol1"))
	if err != nil || st.Size() != 8<<20 {
		t.Fatalf("image: %v %v, want 8 MiB", st, err)
	}
	vdir := n.VolumeDir("vol1")
	if err := os.WriteFile(filepath.Join(vdir, "hello"), []byte("from A"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(vdir, "fits"), make([]byte, 2<<20), 0o644); err != nil {
		t.Fatalf("control: 2 MiB into an 8 MiB volume: %v", err)
	}
	err = os.WriteFile(filepath.Join(vdir, "big"), make([]byte, 16<<20), 0o644)
	t.Logf("16 MiB into an 8 MiB volume: %v", err)
	if !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("16 MiB into an 8 MiB volume: %v, want ENOSPC", err)
	}
	_ = os.Remove(filepath.Join(vdir, "big"))

	_, err = n.MountVolumes(ctx, recB)
	t.Logf("B mounts A's volume: %v", err)
	if !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("B mounts A's volume: %v, want FailedPrecondition", err)
	}
	other := &sandbox.Record{ID: "sbb", Volumes: []sandbox.Volume{{ID: "vol2", Path: "/data", SizeMiB: 8}}}
	if _, err := n.MountVolumes(ctx, other); err != nil {
		t.Fatalf("control: B mounts a volume of its own: %v", err)
	}
	if err := n.UnmountVolumes(ctx, other); err != nil {
		t.Fatal(err)
	}
	_, err = n.DeleteVolume(ctx, "vol1")
	t.Logf("delete while A holds it: %v", err)
	if !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("delete while mounted: %v, want FailedPrecondition", err)
	}
	if _, err := n.MountVolumes(ctx, recA); err != nil {
		t.Fatalf("A starts again: %v", err)
	}
	if err := n.UnmountVolumes(ctx, recB); err != nil {
		t.Fatal(err)
	}
	if m, _ := storage.IsMounted(vdir); !m {
		t.Fatal("B's unmount took A's volume away")
	}

	if err := n.UnmountVolumes(ctx, recA); err != nil {
		t.Fatal(err)
	}
	start = time.Now()
	if _, err := n.MountVolumes(ctx, recB); err != nil {
		t.Fatalf("B after A: %v", err)
	}
	t.Logf("mount of an existing volume: %s", time.Since(start).Round(time.Microsecond))
	if b, err := os.ReadFile(filepath.Join(vdir, "hello")); err != nil || !bytes.Equal(b, []byte("from A")) {
		t.Fatalf("B reads %q, %v", b, err)
	}
	if err := n.UnmountVolumes(ctx, recB); err != nil {
		t.Fatal(err)
	}
	if existed, err := n.DeleteVolume(ctx, "vol1"); err != nil || !existed {
		t.Fatalf("delete: %v %v", existed, err)
	}
	if _, err := os.Stat(pool.VolumeImagePath("vol1")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("image after delete: %v", err)
	}
	if existed, err := n.DeleteVolume(ctx, "vol1"); err != nil || existed {
		t.Fatalf("second delete: %v %v", existed, err)
	}

	// A create that fails after its mount (its sandbox still Creating)
	// removes the image it made; recA (not Creating) kept vol1's above.
	recD := &sandbox.Record{ID: "sbd", State: lifecycle.Creating, Volumes: []sandbox.Volume{{ID: "vol5", Path: "/a", SizeMiB: 8}}}
	if _, err := n.MountVolumes(ctx, recD); err != nil {
		t.Fatal(err)
	}
	if err := n.UnmountVolumes(ctx, recD); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Dir(pool.VolumeImagePath("vol5"))); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a failed create left the volume it made: %v", err)
	}

	// The second volume cannot be made: the first, made by this call, is
	// undone with it.
	recC := &sandbox.Record{ID: "sbc", Volumes: []sandbox.Volume{{ID: "vol3", Path: "/a", SizeMiB: 8}, {ID: "vol4", Path: "/b", SizeMiB: 1}}}
	_, err = n.MountVolumes(ctx, recC)
	t.Logf("a mount that fails: %v", err)
	if err == nil {
		t.Fatal("a 1 MiB volume was made")
	}
	for _, p := range []string{pool.VolumeImagePath("vol3"), filepath.Dir(pool.VolumeImagePath("vol3")), pool.VolumeImagePath("vol4"), n.VolumeDir("vol3") + ".owner"} {
		if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s left behind: %v", p, err)
		}
	}
	if m, _ := storage.IsMounted(n.VolumeDir("vol3")); m {
		t.Error("vol3 left mounted")
	}
}
