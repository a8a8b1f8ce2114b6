package integration

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// poolStats reads the disk pool metrics of one template.
func poolStats(t *testing.T, svc *cubelet.Service, tmpl string) (hits, misses, ready float64) {
	t.Helper()
	mfs, err := svc.Metrics().Gather()
	if err != nil {
		t.Fatal(err)
	}
	val := func(m *dto.Metric) float64 {
		if m.Counter != nil {
			return m.Counter.GetValue()
		}
		return m.Gauge.GetValue()
	}
	for _, mf := range mfs {
		for _, m := range mf.Metric {
			if len(m.Label) != 1 || m.Label[0].GetValue() != tmpl {
				continue
			}
			switch mf.GetName() {
			case "cubelet_disk_pool_hits_total":
				hits = val(m)
			case "cubelet_disk_pool_misses_total":
				misses = val(m)
			case "cubelet_disk_pool_ready":
				ready = val(m)
			}
		}
	}
	return hits, misses, ready
}

func waitPoolReady(t *testing.T, svc *cubelet.Service, tmpl string, n float64) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, _, r := poolStats(t, svc, tmpl); r >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("disk pool of %s never reached %v ready disks", tmpl, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestDiskPoolAndHostMounts: creates take ready disks (and grow them when
// asked), a template delete drains its pool; host mounts are bound as
// asked (read-only really read-only), refused outside the allow-list, and
// kept across a rollback.
func TestDiskPoolAndHostMounts(t *testing.T) {
	hostDir := t.TempDir()
	rw, ro := filepath.Join(hostDir, "rw"), filepath.Join(hostDir, "ro")
	for _, d := range []string{rw, ro} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(ro, "dataset"), []byte("read me"), 0o644); err != nil {
		t.Fatal(err)
	}
	env := cubelettest.New(t, fmt.Sprintf(`
[storage.disk_pool]
size = 4
[[storage.host_mount_allow]]
prefix = %q
[[storage.host_mount_allow]]
prefix = %q
read_only = true
`, rw, ro))
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()

	// Imported after start: the first create registers the template and
	// misses; the next ones hit.
	first := mustCreate(t, svc, cubelet.CreateRequest{})
	waitPoolReady(t, svc, "busybox", 4)
	var made []string
	for range 3 {
		made = append(made, mustCreate(t, svc, cubelet.CreateRequest{}).ID)
	}
	big := mustCreate(t, svc, cubelet.CreateRequest{Resources: sandbox.Resources{DiskMiB: 200}})
	if hits, misses, _ := poolStats(t, svc, "busybox"); hits != 4 || misses != 1 {
		t.Fatalf("pool: %v hits, %v misses; want 4 and 1", hits, misses)
	}
	// A pooled disk still grows to the size asked for.
	if st, err := os.Stat(big.Disk.Path); err != nil || st.Size() != 200<<20 {
		t.Fatalf("grown pooled disk: %v %v", st, err)
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(rootfs(env, big.ID), &fs); err != nil || int64(fs.Blocks)*fs.Bsize < 150<<20 {
		t.Fatalf("filesystem of the grown disk: %d bytes, %v", int64(fs.Blocks)*fs.Bsize, err)
	}

	// Host mounts.
	hm := mustCreate(t, svc, cubelet.CreateRequest{HostMounts: []sandbox.HostMount{
		{Source: rw, Destination: "/mnt/rw"},
		{Source: filepath.Join(ro, "dataset"), Destination: "/data/dataset", ReadOnly: true},
	}})
	inSandbox := func(p string) string {
		sb, _ := svc.Get(ctx, hm.ID)
		return fmt.Sprintf("/proc/%d/root%s", sb.Container.PID, p)
	}
	checkMounts := func() {
		t.Helper()
		if b, err := os.ReadFile(inSandbox("/data/dataset")); err != nil || string(b) != "read me" {
			t.Fatalf("read-only bind: %q %v", b, err)
		}
		if err := os.WriteFile(inSandbox("/data/dataset"), []byte("x"), 0o644); !errors.Is(err, unix.EROFS) {
			t.Fatalf("write to a read-only bind: %v", err)
		}
		if err := os.WriteFile(inSandbox("/mnt/rw/out"), []byte("from the sandbox"), 0o644); err != nil {
			t.Fatal(err)
		}
		if b, err := os.ReadFile(filepath.Join(rw, "out")); err != nil || string(b) != "from the sandbox" {
			t.Fatalf("read-write bind not shared with the host: %q %v", b, err)
		}
	}
	checkMounts()
	sn := mustSnapshot(t, svc, cubelet.SnapshotRequest{SandboxID: hm.ID})
	if _, err := svc.Rollback(ctx, cubelet.RollbackRequest{SandboxID: hm.ID, SnapshotID: sn.ID}); err != nil {
		t.Fatal(err)
	}
	checkMounts()
	if err := svc.DeleteSnapshot(ctx, sn.ID); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []sandbox.HostMount{
		{Source: hostDir, Destination: "/mnt"},
		{Source: ro, Destination: "/mnt"},
		{Source: rw, Destination: "/proc/x"},
	} {
		_, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox", HostMounts: []sandbox.HostMount{bad}})
		if !errdefs.IsInvalidArgument(err) {
			t.Errorf("create with host mount %+v: %v", bad, err)
		}
	}

	// Deleting the template drains its pool.
	for _, id := range append(made, first.ID, big.ID, hm.ID) {
		if _, err := svc.Delete(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	if l, _ := svc.List(ctx, cubelet.ListFilter{}); len(l) != 0 {
		t.Fatalf("sandboxes left: %d", len(l))
	}
	if err := svc.DeleteTemplate(ctx, "busybox"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond) // a refill in flight finds its template gone
	if _, err := os.Stat(filepath.Join(env.Config.PoolDir(), "ready", "busybox")); !os.IsNotExist(err) {
		t.Fatalf("ready disks survived the template: %v", readyDisks(env, "busybox"))
	}
	env.AssertNoLeaks(t)
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

func freeBytesOf(t *testing.T, dir string) int64 {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	return int64(st.Bfree) * st.Bsize
}

// TestSnapshotFigures prints the snapshot and clone figures of docs/storage.md and
// checks the space accounting: a sandbox with a 1 GiB disk holding 900 MiB
// of random data is snapshotted 20 times and cloned 20 times (medians
// printed), then cloned 100 times in one call, which must cost far less
// than 100 GiB of pool space; finally a burst of 50 creates measures the
// disk pool's hit rate. Run with -v to see the figures:
//
//	go test -count=1 -v -run TestSnapshotFigures ./internal/cubelet/
func TestSnapshotFigures(t *testing.T) {
	if testing.Short() {
		t.Skip("writes 900 MiB and runs 150 sandboxes")
	}
	env := cubelettest.New(t, "")
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()

	src := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "gib", Resources: sandbox.Resources{DiskMiB: 1024}})
	data := filepath.Join(rootfs(env, src.ID), "data.bin")
	f, err := os.Create(data)
	if err != nil {
		t.Fatal(err)
	}
	chunk := randBytes(1 << 20)
	for i := range 900 {
		chunk[0], chunk[1] = byte(i), byte(i>>8) // no two MiB alike
		if _, err := f.Write(chunk); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}

	var snapTotal, snapDisk, cloneTotal, cloneDisk []time.Duration
	for range 20 {
		start := time.Now()
		res, err := svc.Snapshot(ctx, cubelet.SnapshotRequest{SandboxID: src.ID})
		if err != nil {
			t.Fatal(err)
		}
		snapTotal = append(snapTotal, time.Since(start))
		for _, tm := range res.Timings {
			if tm.Action == "disk" {
				snapDisk = append(snapDisk, tm.Duration)
			}
		}
		if err := svc.DeleteSnapshot(ctx, res.Snapshot.ID); err != nil {
			t.Fatal(err)
		}
	}
	sn := mustSnapshot(t, svc, cubelet.SnapshotRequest{SandboxID: src.ID, SnapshotID: "gib-snap"})
	if sn.SizeBytes < 900<<20 {
		t.Fatalf("snapshot of 900 MiB of data allocates %d bytes (shared extents count)", sn.SizeBytes)
	}
	for range 20 {
		start := time.Now()
		res, err := svc.Clone(ctx, cubelet.CloneRequest{SnapshotID: sn.ID, Count: 1})
		if err != nil {
			t.Fatal(err)
		}
		cloneTotal = append(cloneTotal, time.Since(start))
		for _, tm := range res.Timings {
			if tm.Action == "disk" {
				cloneDisk = append(cloneDisk, tm.Duration)
			}
		}
		if _, err := svc.Delete(ctx, res.Sandboxes[0].ID); err != nil {
			t.Fatal(err)
		}
	}

	// Space: 100 clones of the 1 GiB disk in one call.
	pool := env.Config.PoolDir()
	free0 := freeBytesOf(t, pool)
	start := time.Now()
	cl, err := svc.Clone(ctx, cubelet.CloneRequest{SnapshotID: sn.ID, Count: cubelet.MaxClones})
	if err != nil {
		t.Fatalf("clone 100: %v", err)
	}
	clone100 := time.Since(start)
	used := free0 - freeBytesOf(t, pool)
	var apparent, allocated int64
	for _, c := range cl.Sandboxes {
		var st unix.Stat_t
		if err := unix.Stat(c.Disk.Path, &st); err != nil {
			t.Fatal(err)
		}
		apparent += st.Size
		allocated += st.Blocks * 512
	}
	checkFiles(t, rootfs(env, cl.Sandboxes[99].ID), files{"data.bin": mustRead(t, data)})
	for _, c := range cl.Sandboxes {
		if _, err := svc.Delete(ctx, c.ID); err != nil {
			t.Fatal(err)
		}
	}
	if used > 5<<30 {
		t.Errorf("100 clones of a 1 GiB disk took %d MiB of pool space", used>>20)
	}

	// Pool hit rate under a burst of 50 creates, starting from a full
	// pool (default size).
	size := float64(env.Config.Storage.DiskPool.Size)
	mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "warm"})
	waitPoolReady(t, svc, "busybox", size)
	h0, m0, _ := poolStats(t, svc, "busybox")
	errs := make(chan error, 50)
	ids := make(chan string, 50)
	burst := time.Now()
	for range 50 {
		go func() {
			res, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox"})
			if err == nil {
				ids <- res.Sandbox.ID
			}
			errs <- err
		}()
	}
	for range 50 {
		if err := <-errs; err != nil {
			t.Errorf("burst create: %v", err)
		}
	}
	burstTime := time.Since(burst)
	close(ids)
	h1, m1, _ := poolStats(t, svc, "busybox")
	hits, misses := h1-h0, m1-m0
	for id := range ids {
		if _, err := svc.Delete(ctx, id); err != nil {
			t.Fatal(err)
		}
	}

	t.Logf("FIGURES (1 GiB disk, 900 MiB random data, XFS reflink pool in a loop image, runc):")
	t.Logf("  snapshot: median of 20: %v end to end, %v FICLONE (disk action)", median(snapTotal), median(snapDisk))
	t.Logf("  clone:    median of 20: %v end to end (cold boot, agent up), %v FICLONE (disk action)", median(cloneTotal), median(cloneDisk))
	t.Logf("  clone x100 in one call: %v; pool space used %d MiB (statfs delta); clone disks: %d GiB apparent, %d GiB st_blocks (shared extents counted)",
		clone100.Round(time.Millisecond), used>>20, apparent>>30, allocated>>30)
	t.Logf("  burst of 50 creates, pool size %v: %v hits, %v misses, hit rate %.0f%%, %v",
		size, hits, misses, 100*hits/(hits+misses), burstTime.Round(time.Millisecond))
	if hits+misses != 50 || hits < size {
		t.Errorf("burst: %v hits + %v misses; want 50 with at least %v hits", hits, misses, size)
	}

	for _, id := range []string{"warm", src.ID} {
		if _, err := svc.Delete(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	if err := svc.DeleteSnapshot(ctx, sn.ID); err != nil {
		t.Fatal(err)
	}
	env.AssertNoLeaks(t)
}

func mustRead(t *testing.T, p string) []byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
