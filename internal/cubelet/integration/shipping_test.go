package integration

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/objstore/objstoretest"
)

func storeTOML(srv *objstoretest.Server) string {
	return fmt.Sprintf("[store]\nendpoint = %q\nbucket = %q\naccess_key_file = %q\nsecret_key_file = %q\n",
		srv.Endpoint, srv.Bucket, srv.AccessKeyFile, srv.SecretKeyFile)
}

// TestSnapshotAcrossNodes: a runc sandbox's snapshot exported by one node
// is imported by another (two cubelets with pools of their own, one
// object store) and cloned there with its files intact. The import is
// refused while the second node lacks the snapshot's template (control:
// the same import succeeds once the template is there), and an export
// from a node without [store] is refused.
func TestSnapshotAcrossNodes(t *testing.T) {
	cubelettest.RequireRoot(t)
	srv := objstoretest.Start(t)
	ctx := context.Background()
	env1 := cubelettest.New(t, storeTOML(srv))
	svc1 := env1.Start(t)
	env1.ImportBusybox(t, svc1, "busybox")
	env2 := cubelettest.New(t, storeTOML(srv))
	svc2 := env2.Start(t)
	t.Cleanup(func() {
		for _, svc := range []*cubelet.Service{svc1, svc2} {
			for _, sb := range mustList(t, svc) {
				if _, err := svc.Delete(ctx, sb.ID); err != nil {
					t.Error(err)
				}
			}
			sns, _ := svc.ListSnapshots(ctx, cubelet.SnapshotFilter{})
			for _, sn := range sns {
				_ = svc.DeleteSnapshot(ctx, sn.ID)
			}
		}
	})

	a := mustCreate(t, svc1, cubelet.CreateRequest{Env: map[string]string{"FOO": "bar"}})
	want := files{"data/a.txt": []byte("made on node 1\n"), "data/blob": randBytes(3 << 20)}
	writeFiles(t, rootfs(env1, a.ID), want)
	sn := mustSnapshot(t, svc1, cubelet.SnapshotRequest{SandboxID: a.ID, Name: "travels"})

	exported, tr, err := svc1.ExportSnapshot(ctx, sn.ID)
	if err != nil {
		t.Fatalf("export: %v", err)
	}
	t.Logf("export of %s: %d MiB disk image, %.1f MiB stored, %.1f MiB sent in %v", exported.ID,
		tr.LogicalBytes>>20, float64(tr.StoredBytes)/(1<<20), float64(tr.Sent)/(1<<20), tr.Duration)

	// The second node has no busybox template yet: refused, nothing left.
	_, err = svc2.ImportSnapshot(ctx, sn.ID, false)
	t.Logf("import without the template: %v", err)
	if !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("import without the template: %v, want FailedPrecondition", err)
	}
	if _, err := os.Stat(env2.Config.PoolDir() + "/snapshots/" + sn.ID); !os.IsNotExist(err) {
		t.Fatalf("refused import left files: %v", err)
	}
	env2.ImportBusybox(t, svc2, "busybox")
	res, err := svc2.ImportSnapshot(ctx, sn.ID, false)
	if err != nil {
		t.Fatalf("import: %v", err)
	}
	t.Logf("import on node 2: %.1f MiB received in %v", float64(res.Transfer.Received)/(1<<20), res.Transfer.Duration)
	got, err := svc2.GetSnapshot(ctx, sn.ID)
	if err != nil || got.SandboxID != a.ID || got.Name != "travels" || got.Runtime != "runc" || got.Env["FOO"] != "bar" {
		t.Fatalf("imported record: %+v %v", got, err)
	}
	if _, err := svc2.ImportSnapshot(ctx, sn.ID, false); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Errorf("second import: %v, want AlreadyExists", err)
	}
	cl, err := svc2.Clone(ctx, cubelet.CloneRequest{SnapshotID: sn.ID, Count: 1})
	if err != nil {
		t.Fatalf("clone on node 2: %v", err)
	}
	b := cl.Sandboxes[0]
	mustState(t, svc2, b.ID, "running")
	agentUp(t, svc2, b.ID)
	checkFiles(t, rootfs(env2, b.ID), want)
	assertSnapshotFiles(t, env2, svc2)

	// A node without [store]: refused before anything is read.
	env3 := cubelettest.New(t, "")
	svc3 := env3.Start(t)
	if _, err := svc3.ImportSnapshot(ctx, sn.ID, false); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("import without [store]: %v, want FailedPrecondition", err)
	}
}

// TestGvisorResumeOnAnotherNode: a paused gVisor sandbox moves between
// nodes with its memory: node 1 snapshots it (memory image) and stops it,
// exports the snapshot; node 2 imports it and clones it under the same
// sandbox ID, and the process that held a value only in memory still
// holds it. A node whose gVisor runs on another platform (another memory
// fingerprint) refuses the memory import naming what differs, and imports
// the disk alone when allowed; node 2 (same fingerprint) is the control.
func TestGvisorResumeOnAnotherNode(t *testing.T) {
	cubelettest.RequireRoot(t)
	requireRunsc(t)
	srv := objstoretest.Start(t)
	ctx := context.Background()
	start := func(extra string) (*cubelettest.Env, *cubelet.Service) {
		env := cubelettest.New(t, storeTOML(srv)+extra)
		env.StartNetworkAgent(t, nettest.Options{PoolSize: 2})
		svc := env.Start(t)
		env.ImportBusybox(t, svc, "busybox")
		t.Cleanup(func() {
			for _, sb := range mustList(t, svc) {
				if _, err := svc.Delete(ctx, sb.ID); err != nil {
					t.Error(err)
				}
			}
			sns, _ := svc.ListSnapshots(ctx, cubelet.SnapshotFilter{})
			for _, sn := range sns {
				_ = svc.DeleteSnapshot(ctx, sn.ID)
			}
			assertSnapshotFiles(t, env, svc)
		})
		return env, svc
	}
	_, svc1 := start("")
	_, svc2 := start("")

	a := mustCreate(t, svc1, cubelet.CreateRequest{SandboxID: "gx-a", Runtime: "gvisor"})
	orig := fmt.Sprint(time.Now().UnixNano())
	counter(t, svc1, a.ID, orig)
	holds(t, svc1, a.ID, orig)
	if _, err := svc1.Pause(ctx, a.ID); err != nil {
		t.Fatal(err)
	}
	begin := time.Now()
	sn := mustSnapshot(t, svc1, cubelet.SnapshotRequest{SandboxID: a.ID, Stop: true})
	if !sn.HasMemory {
		t.Fatalf("snapshot %+v: want memory", sn)
	}
	tookSnap := time.Since(begin)
	begin = time.Now()
	_, tr, err := svc1.ExportSnapshot(ctx, sn.ID)
	if err != nil {
		t.Fatalf("export: %v", err)
	}
	t.Logf("node 1: memory snapshot %v, export %v (%d MiB logical, %.1f MiB sent)", tookSnap, time.Since(begin), tr.LogicalBytes>>20, float64(tr.Sent)/(1<<20))

	begin = time.Now()
	imp, err := svc2.ImportSnapshot(ctx, sn.ID, false)
	if err != nil {
		t.Fatalf("import: %v", err)
	}
	tookImport := time.Since(begin)
	cl, err := svc2.Clone(ctx, cubelet.CloneRequest{SnapshotID: sn.ID, Count: 1, SandboxIDs: []string{a.ID}})
	if err != nil {
		t.Fatalf("resume on node 2: %v", err)
	}
	t.Logf("node 2: import %v (%.1f MiB), restore under the same ID %v; cross-node resume %v",
		tookImport, float64(imp.Transfer.Received)/(1<<20), time.Since(begin)-tookImport, time.Since(begin))
	if got := cl.Sandboxes[0].ID; got != a.ID {
		t.Fatalf("resumed as %s, want %s", got, a.ID)
	}
	mustState(t, svc2, a.ID, lifecycle.Running)
	holds(t, svc2, a.ID, orig)

	// Another memory fingerprint: refused, naming it; disk-only allowed.
	_, svc3 := start("[gvisor]\nplatform = \"systrap\"\n")
	_, err = svc3.ImportSnapshot(ctx, sn.ID, false)
	t.Logf("memory import on a node with another gVisor platform: %v", err)
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "platform differs") {
		t.Fatalf("memory import onto another fingerprint: %v", err)
	}
	res, err := svc3.ImportSnapshot(ctx, sn.ID, true)
	if err != nil {
		t.Fatalf("disk-only import: %v", err)
	}
	if res.Snapshot.HasMemory || !strings.Contains(res.MemoryDropped, "platform differs") {
		t.Fatalf("disk-only import: has_memory %v, dropped %q", res.Snapshot.HasMemory, res.MemoryDropped)
	}
}
