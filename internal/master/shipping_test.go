package master_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/objstore"
	"github.com/cubesandbox/cube/internal/objstore/objstoretest"
)

// TestSnapshotAcrossNodes: with store.export_snapshots the master exports
// a snapshot as it is taken; when the snapshot's node is cordoned, a
// create from it imports it on the other node and clones there, with the
// sandbox's files intact. Control: once the store no longer holds the
// snapshot, the same create fails, saying it was never exported.
func TestSnapshotAcrossNodes(t *testing.T) {
	srv := objstoretest.Start(t)
	store := fmt.Sprintf("[store]\nendpoint = %q\nbucket = %q\naccess_key_file = %q\nsecret_key_file = %q\n",
		srv.Endpoint, srv.Bucket, srv.AccessKeyFile, srv.SecretKeyFile)
	m := mastertest.StartMaster(t, "[store]\nexport_snapshots = true\n")
	n1 := mastertest.StartNodeConfig(t, m, noVM+store, "busybox")
	n2 := mastertest.StartNodeConfig(t, m, noVM+store, "busybox")
	m.WaitHealthy(t, n1, n2)
	nodes := map[string]*mastertest.Node{n1.ID: n1, n2.ID: n2}
	svc := m.Server.Service
	ctx := context.Background()

	sb, err := svc.Create(ctx, master.CreateRequest{Template: "busybox", Timeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = svc.Kill(context.Background(), sb.ID) })
	home := nodes[sb.NodeID]
	var other *mastertest.Node
	for id, n := range nodes {
		if id != sb.NodeID {
			other = n
		}
	}
	want := []byte("written on " + home.ID + "\n")
	p := filepath.Join(home.Env.Config.SandboxRunDir(sb.ID), "rootfs", "data", "note")
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, want, 0o644); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	snap, err := svc.Snapshot(ctx, sb.ID, "")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("snapshot and export: %v", time.Since(start))
	t.Cleanup(func() { _ = svc.DeleteSnapshot(context.Background(), snap.ID) })

	if _, err := svc.SetSchedulable(ctx, home.ID, false); err != nil {
		t.Fatal(err)
	}
	start = time.Now()
	moved, err := svc.Create(ctx, master.CreateRequest{Template: snap.ID, Timeout: time.Minute})
	if err != nil {
		t.Fatalf("create from a snapshot whose node is cordoned: %v", err)
	}
	t.Logf("create from snapshot on the other node (import, clone, agent up): %v", time.Since(start))
	t.Cleanup(func() { _ = svc.Kill(context.Background(), moved.ID) })
	if moved.NodeID != other.ID {
		t.Fatalf("created on %s, want %s", moved.NodeID, other.ID)
	}
	got, err := os.ReadFile(filepath.Join(other.Env.Config.SandboxRunDir(moved.ID), "rootfs", "data", "note"))
	if err != nil || string(got) != string(want) {
		t.Fatalf("file on the other node: %q %v, want %q", got, err, want)
	}
	if _, err := os.Stat(filepath.Join(other.Env.Config.PoolDir(), "snapshots", snap.ID)); !os.IsNotExist(err) {
		t.Errorf("imported copy left on %s: %v", other.ID, err)
	}

	// Control: the same create with the snapshot gone from the store.
	st, err := objstore.Open(objstore.Config{Endpoint: srv.Endpoint, Bucket: srv.Bucket, AccessKeyFile: srv.AccessKeyFile, SecretKeyFile: srv.SecretKeyFile})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Delete(ctx, snap.ID, time.Hour); err != nil {
		t.Fatal(err)
	}
	_, err = svc.Create(ctx, master.CreateRequest{Template: snap.ID, Timeout: time.Minute})
	t.Logf("create with the snapshot not in the store: %v", err)
	if err == nil || !strings.Contains(err.Error(), "never exported") {
		t.Fatalf("create with the snapshot not in the store: %v", err)
	}
	if _, err := svc.SetSchedulable(ctx, home.ID, true); err != nil {
		t.Fatal(err)
	}
}

// TestResumeOnAnotherNode: a paused runc sandbox whose node is cordoned
// resumes on the other node under the same ID, with its files (runc has no
// memory image: its processes start afresh); the original is gone from its
// first node. Control: with the node uncordoned a pause and resume stays
// on the node it is on.
func TestResumeOnAnotherNode(t *testing.T) {
	srv := objstoretest.Start(t)
	store := fmt.Sprintf("[store]\nendpoint = %q\nbucket = %q\naccess_key_file = %q\nsecret_key_file = %q\n",
		srv.Endpoint, srv.Bucket, srv.AccessKeyFile, srv.SecretKeyFile)
	m := mastertest.StartMaster(t, "")
	n1 := mastertest.StartNodeConfig(t, m, noVM+store, "busybox")
	n2 := mastertest.StartNodeConfig(t, m, noVM+store, "busybox")
	m.WaitHealthy(t, n1, n2)
	nodes := map[string]*mastertest.Node{n1.ID: n1, n2.ID: n2}
	svc := m.Server.Service
	ctx := context.Background()

	sb, err := svc.Create(ctx, master.CreateRequest{Template: "busybox", Timeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = svc.Kill(context.Background(), sb.ID) })
	home := nodes[sb.NodeID]
	want := []byte("kept across nodes\n")
	p := filepath.Join(home.Env.Config.SandboxRunDir(sb.ID), "rootfs", "data", "note")
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, want, 0o644); err != nil {
		t.Fatal(err)
	}

	// Control: not cordoned, the resume stays put.
	if err := svc.Pause(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	if up, err := svc.Resume(ctx, sb.ID, time.Minute); err != nil || up.NodeID != home.ID {
		t.Fatalf("resume on an uncordoned node: %+v %v", up, err)
	}

	if err := svc.Pause(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := svc.SetSchedulable(ctx, home.ID, false); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = svc.SetSchedulable(context.Background(), home.ID, true) })
	begin := time.Now()
	up, err := svc.Resume(ctx, sb.ID, time.Minute)
	if err != nil {
		t.Fatalf("resume with its node cordoned: %v", err)
	}
	t.Logf("cross-node resume (snapshot, export, import, clone under the same ID, agent up): %v", time.Since(begin))
	if up.ID != sb.ID || up.NodeID == home.ID || up.State != "running" {
		t.Fatalf("after resume: %+v", up)
	}
	other := nodes[up.NodeID]
	got, err := os.ReadFile(filepath.Join(other.Env.Config.SandboxRunDir(sb.ID), "rootfs", "data", "note"))
	if err != nil || string(got) != string(want) {
		t.Fatalf("file after the move: %q %v", got, err)
	}
	st, err := objstore.Open(objstore.Config{Endpoint: srv.Endpoint, Bucket: srv.Bucket, AccessKeyFile: srv.AccessKeyFile, SecretKeyFile: srv.SecretKeyFile})
	if err != nil {
		t.Fatal(err)
	}
	// The move answered first; its tidying up (the original destroyed,
	// every copy of its snapshot deleted) follows in the background.
	tidied := time.Now()
	left := func() []string {
		var l []string
		if _, err := home.Svc.Get(ctx, sb.ID); err == nil {
			l = append(l, "the sandbox on its first node")
		}
		if sns, _ := other.Svc.ListSnapshots(ctx, cubelet.SnapshotFilter{}); len(sns) != 0 {
			l = append(l, fmt.Sprintf("%d snapshots on the new node", len(sns)))
		}
		if sns, _ := home.Svc.ListSnapshots(ctx, cubelet.SnapshotFilter{}); len(sns) != 0 {
			l = append(l, fmt.Sprintf("%d snapshots on the first node", len(sns)))
		}
		if ids, err := st.List(ctx); err != nil || len(ids) != 0 {
			l = append(l, fmt.Sprintf("the move's snapshot in the store: %v %v", ids, err))
		}
		if snaps, _, err := svc.ListSnapshots(ctx, catalog.SnapshotQuery{}); err != nil || len(snaps) != 0 {
			l = append(l, fmt.Sprintf("the move's snapshot in the catalog: %d %v", len(snaps), err))
		}
		return l
	}
	mastertest.WaitFor(t, 20*time.Second, "the move to tidy up", func() bool { return len(left()) == 0 })
	t.Logf("tidied up %s after the answer", time.Since(tidied).Round(time.Millisecond))
}
