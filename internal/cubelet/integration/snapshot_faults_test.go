package integration

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/lifecycle"
)

// TestSnapshotRollbackCycles snapshots and rolls back one sandbox 100
// times, checking the content byte for byte at every step, with a
// retention of 2 snapshots per sandbox pruning as it goes.
func TestSnapshotRollbackCycles(t *testing.T) {
	env := cubelettest.New(t, "[snapshots]\nmax_per_sandbox = 2\n")
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()
	sb := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "cycles"})
	defer func() {
		if _, err := svc.Delete(ctx, sb.ID); err != nil {
			t.Error(err)
		}
		for _, sn := range listSnaps(t, svc, "") {
			_ = svc.DeleteSnapshot(ctx, sn)
		}
		assertSnapshotFiles(t, env, svc)
		env.AssertNoLeaks(t)
	}()
	root := rootfs(env, sb.ID)
	const cycles = 100
	for i := range cycles {
		want := files{
			"work/state.txt": fmt.Appendf(nil, "cycle %d\n", i),
			"work/blob":      randBytes(4096 + i),
			"work/extra":     nil,
		}
		writeFiles(t, root, want)
		sn := mustSnapshot(t, svc, cubelet.SnapshotRequest{SandboxID: sb.ID})
		writeFiles(t, root, files{"work/state.txt": []byte("dirty"), "work/blob": nil, "work/extra": randBytes(100)})
		if _, err := svc.Rollback(ctx, cubelet.RollbackRequest{SandboxID: sb.ID, SnapshotID: sn.ID}); err != nil {
			t.Fatalf("cycle %d: rollback: %v", i, err)
		}
		checkFiles(t, root, want)
		if t.Failed() {
			t.Fatalf("cycle %d: content differs after rollback", i)
		}
		if n := len(listSnaps(t, svc, sb.ID)); n > 2 {
			t.Fatalf("cycle %d: retention kept %d snapshots", i, n)
		}
	}
	mustState(t, svc, sb.ID, lifecycle.Running)
	agentUp(t, svc, sb.ID)
	assertSnapshotFiles(t, env, svc)
}

func listSnaps(t *testing.T, svc *cubelet.Service, sandboxID string) []string {
	t.Helper()
	sns, err := svc.ListSnapshots(context.Background(), cubelet.SnapshotFilter{SandboxID: sandboxID})
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, sn := range sns {
		ids = append(ids, sn.ID)
	}
	return ids
}

// TestSnapshotFaults injects a failure before and after every action of
// the snapshot, clone and rollback flows (and into the undo of a
// rollback) and checks that the sandbox is as it was, or Failed and
// released, with no snapshot record, file or host resource left.
func TestSnapshotFaults(t *testing.T) {
	env := cubelettest.New(t, "")
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()
	sb := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "faulty"})
	root := rootfs(env, sb.ID)
	v1 := files{"f/a": []byte("one"), "f/b": randBytes(8192)}
	writeFiles(t, root, v1)
	base := mustSnapshot(t, svc, cubelet.SnapshotRequest{SandboxID: sb.ID, SnapshotID: "base"})
	v2 := files{"f/a": []byte("two"), "f/b": nil, "f/c": []byte("c")}
	writeFiles(t, root, v2)

	// asWas checks the sandbox is back in state st with v2 on its disk,
	// its agent answering, and no snapshot but base.
	asWas := func(t *testing.T, st lifecycle.State) {
		t.Helper()
		mustState(t, svc, sb.ID, st)
		want := "THAWED"
		if st == lifecycle.Paused {
			want = "FROZEN"
		}
		if got := freezerState(t, env, sb.ID); got != want {
			t.Fatalf("freezer %s, want %s", got, want)
		}
		if st == lifecycle.Running {
			agentUp(t, svc, sb.ID)
		}
		checkFiles(t, root, v2)
		if ids := listSnaps(t, svc, ""); len(ids) != 1 || ids[0] != "base" {
			t.Fatalf("snapshots after a failed verb: %v", ids)
		}
		if _, err := os.Stat(sb.Disk.Path + ".staged"); !os.IsNotExist(err) {
			t.Fatalf("staged disk left: %v", err)
		}
		assertSnapshotFiles(t, env, svc)
	}

	for _, st := range []lifecycle.State{lifecycle.Running, lifecycle.Paused} {
		if st == lifecycle.Paused {
			if _, err := svc.Pause(ctx, sb.ID); err != nil {
				t.Fatal(err)
			}
		}
		t.Run("snapshot/"+string(st), func(t *testing.T) {
			for _, p := range points(svc, cubelet.FlowSnapshot) {
				t.Run(p, func(t *testing.T) {
					inject(t, p, "1*error")
					_, err := svc.Snapshot(ctx, cubelet.SnapshotRequest{SandboxID: sb.ID, SnapshotID: "never"})
					if !errors.Is(err, failpoint.ErrInjected) {
						t.Fatalf("want injected error, got %v", err)
					}
					asWas(t, st)
				})
			}
		})
		t.Run("rollback/"+string(st), func(t *testing.T) {
			for _, p := range points(svc, cubelet.FlowRollback) {
				t.Run(p, func(t *testing.T) {
					inject(t, p, "1*error")
					_, err := svc.Rollback(ctx, cubelet.RollbackRequest{SandboxID: sb.ID, SnapshotID: base.ID})
					if !errors.Is(err, failpoint.ErrInjected) {
						t.Fatalf("want injected error, got %v", err)
					}
					asWas(t, st)
				})
			}
		})
	}
	if _, err := svc.Resume(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}

	// A thaw that fails and whose undo fails too leaves the sandbox
	// frozen: it is reported Paused, the truth, and can be resumed.
	t.Run("snapshot/thaw-undo", func(t *testing.T) {
		inject(t, "snapshot/thaw", "1*error")
		inject(t, "snapshot/container/undo", "1*error")
		_, err := svc.Snapshot(ctx, cubelet.SnapshotRequest{SandboxID: sb.ID})
		if !errors.Is(err, failpoint.ErrInjected) {
			t.Fatalf("want injected error, got %v", err)
		}
		asWas(t, lifecycle.Paused)
		if _, err := svc.Resume(ctx, sb.ID); err != nil {
			t.Fatal(err)
		}
		asWas(t, lifecycle.Running)
	})

	// Clone is all or nothing: one clone failing destroys the others.
	t.Run("clone", func(t *testing.T) {
		for _, p := range points(svc, cubelet.FlowClone) {
			t.Run(p, func(t *testing.T) {
				inject(t, p, "1*error")
				_, err := svc.Clone(ctx, cubelet.CloneRequest{SnapshotID: base.ID, Count: 3})
				if !errors.Is(err, failpoint.ErrInjected) {
					t.Fatalf("want injected error, got %v", err)
				}
				if l, _ := svc.List(ctx, cubelet.ListFilter{}); len(l) != 1 {
					t.Fatalf("failed clone left %d sandboxes", len(l)-1)
				}
				asWas(t, lifecycle.Running)
			})
		}
	})

	// A rollback whose undo fails too: the sandbox is Failed, holds
	// nothing, and deletes cleanly.
	t.Run("rollback/undo-fails", func(t *testing.T) {
		inject(t, "rollback/agent", "1*error")
		inject(t, "rollback/container/undo", "1*error")
		_, err := svc.Rollback(ctx, cubelet.RollbackRequest{SandboxID: sb.ID, SnapshotID: base.ID})
		if !errors.Is(err, failpoint.ErrInjected) {
			t.Fatalf("want injected error, got %v", err)
		}
		got, _ := svc.Get(ctx, sb.ID)
		if got.State != lifecycle.Failed || got.Error == "" || got.Container != nil || got.Mount != nil || got.Disk != nil {
			t.Fatalf("after a failed undo: %+v", got)
		}
		if _, err := svc.Rollback(ctx, cubelet.RollbackRequest{SandboxID: sb.ID, SnapshotID: base.ID}); !errdefs.IsFailedPrecondition(err) {
			t.Fatalf("rollback of a failed sandbox: %v", err)
		}
		if _, err := svc.Delete(ctx, sb.ID); err != nil {
			t.Fatal(err)
		}
	})

	if err := svc.DeleteSnapshot(ctx, base.ID); err != nil {
		t.Fatal(err)
	}
	assertSnapshotFiles(t, env, svc)
	env.AssertNoLeaks(t)
}

// TestSnapshotRetentionAndRefs: node-wide count and age retention (after
// each snapshot and from the GC loop), and a snapshot deleted while a
// clone reads it keeps its files until the clone is done.
func TestSnapshotRetentionAndRefs(t *testing.T) {
	env := cubelettest.New(t, "[snapshots]\nmax_per_node = 3\nmax_age = \"6s\"\n")
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()
	a := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "ret-a"})
	b := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "ret-b"})
	var taken []string
	for i := range 5 {
		sb := a
		if i%2 == 1 {
			sb = b
		}
		taken = append(taken, mustSnapshot(t, svc, cubelet.SnapshotRequest{SandboxID: sb.ID, SnapshotID: fmt.Sprintf("ret-%d", i)}).ID)
		if ids := listSnaps(t, svc, ""); len(ids) > 3 {
			t.Fatalf("after snapshot %d: %d snapshots kept, max_per_node is 3", i, len(ids))
		}
	}
	if ids := listSnaps(t, svc, ""); len(ids) != 3 || ids[0] != taken[2] || ids[2] != taken[4] {
		t.Fatalf("retention kept %v, want the newest 3 of %v", ids, taken)
	}
	assertSnapshotFiles(t, env, svc)

	// Delete a snapshot while a clone of it is between its disk and its
	// container: the clone still succeeds, the files outlive the record
	// until it is done.
	inject(t, "clone/container", "1*sleep(1s)")
	done := make(chan error, 1)
	go func() {
		_, err := svc.Clone(ctx, cubelet.CloneRequest{SnapshotID: taken[4], Count: 1, SandboxIDs: []string{"ret-clone"}})
		done <- err
	}()
	dir := filepath.Join(env.Config.PoolDir(), "snapshots", taken[4])
	for {
		if _, err := svc.Get(ctx, "ret-clone"); err == nil {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := svc.DeleteSnapshot(ctx, taken[4]); err != nil {
		t.Fatal(err)
	}
	if _, err := svc.GetSnapshot(ctx, taken[4]); !errdefs.IsNotFound(err) {
		t.Fatalf("deleted snapshot still listed: %v", err)
	}
	if _, err := os.Stat(dir); err != nil {
		t.Fatalf("files of a snapshot in use removed: %v", err)
	}
	if err := <-done; err != nil {
		t.Fatalf("clone of a snapshot deleted meanwhile: %v", err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("files of the deleted snapshot outlived its last user: %v", err)
	}

	// Age: the GC loop removes the rest once they are older than 6s. A
	// pass deletes a record before its files, so wait for both.
	deadline := time.Now().Add(15 * time.Second)
	snapDirs := func() []os.DirEntry {
		ents, _ := os.ReadDir(filepath.Join(env.Config.PoolDir(), "snapshots"))
		return ents
	}
	for len(listSnaps(t, svc, "")) > 0 || len(snapDirs()) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("max_age: snapshots still there: records %v, %d dirs", listSnaps(t, svc, ""), len(snapDirs()))
		}
		time.Sleep(100 * time.Millisecond)
	}
	assertSnapshotFiles(t, env, svc)
	for _, id := range []string{a.ID, b.ID, "ret-clone"} {
		if _, err := svc.Delete(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	env.AssertNoLeaks(t)
}
