package integration

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/errdefs/grpcerr"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/nospace/nospacetest"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/store"
)

// wantNoSpace fails t unless err is an ErrNoSpace whose message names the
// filesystem mounted at mnt, also once it has crossed the gRPC edge.
func wantNoSpace(t *testing.T, what string, err error, mnt string) {
	t.Helper()
	t.Logf("%s on a full disk: %v", what, err)
	if !errdefs.IsNoSpace(err) || !strings.Contains(err.Error(), mnt) {
		t.Fatalf("%s: %v, want ErrNoSpace naming %s", what, err, mnt)
	}
	if remote := grpcerr.FromGRPC(grpcerr.ToGRPC(err)); !errdefs.IsNoSpace(remote) {
		t.Fatalf("%s: over gRPC %v is no ErrNoSpace", what, remote)
	}
}

// TestDiskFullDataDir: with the data dir (store, pool, templates and
// snapshots on one reflink XFS, as /var/lib/cube) full, a template import
// and a create fail with ErrNoSpace naming it and leave nothing (no
// record, no file, no mount), a snapshot either succeeds or fails the same
// way with the sandbox still running, a sandbox's own write fails at
// fsync, and once space returns the same operations succeed in the same
// cubelet.
func TestDiskFullDataDir(t *testing.T) {
	cubelettest.RequireRoot(t)
	data := nospacetest.Mount(t, "xfs", 400) // before New: its cleanup runs after the env's
	env := cubelettest.New(t, "")
	env.Config.Node.DataDir = data
	env.OwnMounts = []string{data}
	svc := env.Start(t)
	ctx := context.Background()

	free := nospacetest.Fill(t, data)
	_, err := svc.ImportTemplate(ctx, "busybox", env.Image, nil)
	wantNoSpace(t, "template import", err, data)
	if _, err := svc.GetTemplate(ctx, "busybox"); !errdefs.IsNotFound(err) {
		t.Fatalf("failed import left a template: %v", err)
	}
	if _, err := os.Stat(filepath.Join(env.Config.PoolDir(), "templates", "busybox")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("failed import left files: %v", err)
	}
	free()
	// Room to start: the import gets as far as writing its image and runs
	// out part way; it still leaves nothing.
	free = nospacetest.FillLeaving(t, data, 2<<20)
	_, err = svc.ImportTemplate(ctx, "busybox", env.Image, nil)
	wantNoSpace(t, "template import with 2 MiB free", err, data)
	if _, err := svc.GetTemplate(ctx, "busybox"); !errdefs.IsNotFound(err) {
		t.Fatalf("failed import left a template: %v", err)
	}
	for _, dir := range []string{filepath.Join(env.Config.PoolDir(), "templates", "busybox"), filepath.Join(env.Config.PoolDir(), "tmp")} {
		if ents, _ := os.ReadDir(dir); len(ents) != 0 {
			t.Fatalf("failed import left %d entries in %s", len(ents), dir)
		}
	}
	free()
	env.ImportBusybox(t, svc, "busybox")

	a := mustCreate(t, svc, cubelet.CreateRequest{})
	writeFiles(t, rootfs(env, a.ID), files{"data/before": []byte("written before the disk filled\n")})

	free = nospacetest.Fill(t, data)
	_, err = svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox"})
	wantNoSpace(t, "create", err, data)
	if l, _ := svc.List(ctx, cubelet.ListFilter{}); len(l) != 1 || l[0].ID != a.ID {
		t.Fatalf("after the failed create the node lists %d sandboxes", len(l))
	}
	snap, err := svc.Snapshot(ctx, cubelet.SnapshotRequest{SandboxID: a.ID})
	if err != nil {
		wantNoSpace(t, "snapshot", err, data)
		if n := listSnaps(t, svc, a.ID); len(n) != 0 {
			t.Fatalf("failed snapshot left %v", n)
		}
	} else {
		t.Logf("snapshot on a full disk succeeded (reflink took no new block): %s", snap.Snapshot.ID)
	}
	mustState(t, svc, a.ID, lifecycle.Running)
	agentUp(t, svc, a.ID)
	// A program in the sandbox that writes new blocks: its disk is a
	// sparse clone in the pool, so the pool must allocate, and the write
	// fails at fsync (the kernel passes the loop device's ENOSPC on).
	werr := writeSync(filepath.Join(rootfs(env, a.ID), "data", "during"), 8<<20)
	t.Logf("sandbox write of 8 MiB on a full pool: %v", werr)
	if werr == nil {
		t.Fatal("a sandbox's write and fsync on a full pool succeeded")
	}

	free()
	if err := writeSync(filepath.Join(rootfs(env, a.ID), "data", "after"), 8<<20); err != nil {
		t.Errorf("sandbox write after freeing space: %v", err)
	}
	b := mustCreate(t, svc, cubelet.CreateRequest{})
	// The snapshot's flush (syncfs) reports the sandbox disk's failed
	// writeback once; that attempt fails as a full pool, the next succeeds.
	if _, err := svc.Snapshot(ctx, cubelet.SnapshotRequest{SandboxID: a.ID}); err != nil {
		wantNoSpace(t, "first snapshot after the space returned", err, data)
		mustSnapshot(t, svc, cubelet.SnapshotRequest{SandboxID: a.ID})
	}
	checkFiles(t, rootfs(env, a.ID), files{"data/before": []byte("written before the disk filled\n")})
	for _, id := range []string{a.ID, b.ID} {
		if _, err := svc.Delete(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	for _, sn := range listSnaps(t, svc, "") {
		if err := svc.DeleteSnapshot(ctx, sn); err != nil {
			t.Fatal(err)
		}
	}
	env.AssertNoLeaks(t)
}

// writeSync writes n bytes to path and syncs them, as a program in the
// sandbox that cares about its data would.
func writeSync(path string, n int) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	_, werr := f.Write(make([]byte, n))
	serr := f.Sync()
	cerr := f.Close()
	return errors.Join(werr, serr, cerr)
}

// TestDiskFullRunDir: with the run dir (bundles, runtime state; a tmpfs
// as /run/cube) full, a create fails with ErrNoSpace naming it and leaves
// nothing, a running sandbox is untouched, and the same create succeeds
// once space returns.
func TestDiskFullRunDir(t *testing.T) {
	cubelettest.RequireRoot(t)
	run := nospacetest.Mount(t, "tmpfs", 16)
	env := cubelettest.New(t, "")
	c := env.Config
	c.Node.RunDir = run
	env.OwnMounts = []string{run}
	c.Runc.Root, c.Gvisor.Root, c.VM.Root = filepath.Join(run, "runc"), filepath.Join(run, "runsc"), filepath.Join(run, "vm")
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()
	a := mustCreate(t, svc, cubelet.CreateRequest{})

	free := nospacetest.Fill(t, run)
	_, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox"})
	wantNoSpace(t, "create", err, run)
	if l, _ := svc.List(ctx, cubelet.ListFilter{}); len(l) != 1 {
		t.Fatalf("after the failed create the node lists %d sandboxes", len(l))
	}
	mustState(t, svc, a.ID, lifecycle.Running)
	agentUp(t, svc, a.ID)

	free()
	b := mustCreate(t, svc, cubelet.CreateRequest{})
	for _, id := range []string{a.ID, b.ID} {
		if _, err := svc.Delete(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	env.AssertNoLeaks(t)
}

// TestQuarantinedRecord: one sandbox record made undecodable while
// cubelet is down is quarantined when it starts (error log with the key,
// the bytes kept in the quarantine bucket), the other sandbox is adopted
// and served with its files, and what the quarantined one held on the node
// is swept as an orphan. The control: both records decode before the
// damage and both sandboxes are served after a plain restart.
func TestQuarantinedRecord(t *testing.T) {
	env := cubelettest.New(t, "")
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()
	good := mustCreate(t, svc, cubelet.CreateRequest{})
	bad := mustCreate(t, svc, cubelet.CreateRequest{})
	writeFiles(t, rootfs(env, good.ID), files{"data/kept": []byte("kept\n")})

	// Control: a restart with both records intact serves both.
	svc.Close()
	svc = env.Start(t)
	for _, id := range []string{good.ID, bad.ID} {
		mustState(t, svc, id, lifecycle.Running)
	}
	svc.Close()

	st, err := store.Open(env.Config.StorePath())
	if err != nil {
		t.Fatal(err)
	}
	if q, _ := st.ListQuarantined(); len(q) != 0 {
		t.Fatalf("control: quarantined %v", q)
	}
	st.Close()
	db, err := bolt.Open(env.Config.StorePath(), 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	garbage := []byte(`{"id":"` + bad.ID + `","state":`)
	if err := db.Update(func(tx *bolt.Tx) error { return tx.Bucket([]byte("sandboxes")).Put([]byte(bad.ID), garbage) }); err != nil {
		t.Fatal(err)
	}
	db.Close()

	svc = env.Start(t)
	mustState(t, svc, good.ID, lifecycle.Running)
	agentUp(t, svc, good.ID)
	checkFiles(t, rootfs(env, good.ID), files{"data/kept": []byte("kept\n")})
	if _, err := svc.Get(ctx, bad.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("quarantined sandbox still served: %v", err)
	}
	// The node still works: a create and a delete.
	c := mustCreate(t, svc, cubelet.CreateRequest{})
	for _, id := range []string{good.ID, c.ID} {
		if _, err := svc.Delete(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	svc.Close()
	st, err = store.Open(env.Config.StorePath())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	q, err := st.ListQuarantined()
	if err != nil || len(q) != 1 || q[0].Key != bad.ID || q[0].Bucket != "sandboxes" || string(q[0].Value) != string(garbage) {
		t.Fatalf("quarantine bucket: %+v %v", q, err)
	}
	t.Logf("quarantined %s/%s: %s", q[0].Bucket, q[0].Key, q[0].Error)
	// The quarantined sandbox's container, mounts and disk were orphans
	// of the restart and are gone.
	env.AssertNoLeaks(t)
}

// TestGvisorPauseToDiskFull: pausing a gVisor sandbox to disk with the
// pool full, or with room for only part of the memory image, fails as
// ErrNoSpace naming the pool, leaves no memory image (not even a partial
// one) and the sandbox running with its memory; once space returns the same
// pause succeeds and the sandbox resumes with its memory.
func TestGvisorPauseToDiskFull(t *testing.T) {
	cubelettest.RequireRoot(t)
	requireRunsc(t)
	ctx := context.Background()
	env := cubelettest.New(t, "")
	env.StartNetworkAgent(t, nettest.Options{PoolSize: 2})
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	a := mustCreate(t, svc, cubelet.CreateRequest{Runtime: "gvisor"})
	image := filepath.Join(env.Config.PoolDir(), "sandboxes", a.ID, "paused-memory")
	setMemory(t, svc, a.ID, map[string]string{"SECRET": "kept"})

	free := nospacetest.Fill(t, env.Config.PoolDir())
	_, err := svc.PauseTo(ctx, a.ID, sandbox.PauseDisk)
	wantNoSpace(t, "pause to disk", err, env.Config.PoolDir())
	if _, err := os.Stat(image); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("failed pause left its memory image: %v", err)
	}
	mustState(t, svc, a.ID, lifecycle.Running)
	wantMemory(t, svc, a.ID, map[string]string{"SECRET": "kept"})
	free()

	// Room for part of the image: runsc runs out while writing it, and
	// the undo removes the partial image.
	free = nospacetest.FillLeaving(t, env.Config.PoolDir(), 512<<10)
	_, err = svc.PauseTo(ctx, a.ID, sandbox.PauseDisk)
	wantNoSpace(t, "pause to disk with 512 KiB free", err, env.Config.PoolDir())
	if _, err := os.Stat(image); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("failed pause left its partial memory image: %v", err)
	}
	mustState(t, svc, a.ID, lifecycle.Running)
	wantMemory(t, svc, a.ID, map[string]string{"SECRET": "kept"})

	free()
	res, err := svc.PauseTo(ctx, a.ID, sandbox.PauseDisk)
	if err != nil || res.Sandbox.PauseMode != sandbox.PauseDisk {
		t.Fatalf("pause to disk after freeing space: %v", err)
	}
	if _, err := svc.Resume(ctx, a.ID); err != nil {
		t.Fatalf("resume: %v", err)
	}
	wantMemory(t, svc, a.ID, map[string]string{"SECRET": "kept"})
	if _, err := svc.Delete(ctx, a.ID); err != nil {
		t.Fatal(err)
	}
	env.AssertNoLeaks(t)
}
