package integration

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/errdefs/grpcerr"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/nospace/nospacetest"
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
	werr := writeSync(filepath.Join(rootfs(env, a.ID), "data", "during"), 8<<20)
	t.Logf("sandbox write of 8 MiB on a full pool: %v", werr)

	free()
	if err := writeSync(filepath.Join(rootfs(env, a.ID), "data", "after"), 8<<20); err != nil {
		t.Errorf("sandbox write after freeing space: %v", err)
	}
	b := mustCreate(t, svc, cubelet.CreateRequest{})
	for _, id := range []string{a.ID, b.ID} {
		if _, err := svc.Delete(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	env.AssertNoLeaks(t)
}
