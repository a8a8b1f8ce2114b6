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
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/objstore"
	"github.com/cubesandbox/cube/internal/objstore/objstoretest"
)

// TestLostNode: a node that stops heartbeating (its cubelet gone, as with
// a lost host) has its sandboxes marked failed once nodes.lost_after
// has passed, with an event naming the node, while another node's stay
// running; when the node comes back with the sandbox still running, its
// registration's reconcile sets the row back to running. The control is
// the same sandbox before the window: still running.
func TestLostNode(t *testing.T) {
	m := mastertest.StartMaster(t, "[nodes]\nunhealthy_after = \"2s\"\nlost_after = \"2s\"\n")
	a := mastertest.StartNode(t, m, "busybox")
	b := mastertest.StartNode(t, m, "busybox")
	m.WaitHealthy(t, a, b)
	ctx := context.Background()
	svc := m.Server.Service
	on := map[string]*catalog.Sandbox{}
	var ids []string
	t.Cleanup(func() {
		for _, id := range ids {
			_ = svc.Kill(ctx, id)
		}
	})
	for len(on) < 2 {
		sb, err := svc.Create(ctx, master.CreateRequest{Template: "busybox", Timeout: 10 * time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, sb.ID)
		if on[sb.NodeID] == nil {
			on[sb.NodeID] = sb
		}
		if len(ids) > 8 {
			t.Fatal("every sandbox on one node")
		}
	}
	lost, kept := on[a.ID], on[b.ID]
	state := func(id string) string {
		sb, err := svc.Get(ctx, id)
		if err != nil {
			return err.Error()
		}
		return sb.State
	}
	stopped := time.Now()
	a.Stop() // heartbeats stop; the sandbox runs on
	time.Sleep(time.Second)
	if s := state(lost.ID); s != catalog.StateRunning {
		t.Fatalf("control: within the window the silent node's sandbox is %q, want running", s)
	}
	mastertest.WaitFor(t, 15*time.Second, "the silent node's sandbox to be failed", func() bool { return state(lost.ID) == catalog.StateFailed })
	t.Logf("sandbox %s on silent node failed %s after its heartbeats stopped (lost_after 2s)", lost.ID, time.Since(stopped).Round(time.Millisecond))
	if s := state(kept.ID); s != catalog.StateRunning {
		t.Errorf("sandbox on the live node is %q", s)
	}
	// The row turns failed before its event is written: wait for the
	// event rather than reading it at the instant the state changed.
	mastertest.WaitFor(t, 5*time.Second, "an event naming the lost node", func() bool {
		evs, err := svc.Events(ctx, catalog.EventQuery{SandboxID: lost.ID})
		if err != nil {
			return false
		}
		for _, ev := range evs {
			if strings.Contains(ev.Message, "node "+a.ID+" lost: no heartbeat since") {
				return true
			}
		}
		return false
	})
	a.Start()
	m.WaitHealthy(t, a)
	mastertest.WaitFor(t, 15*time.Second, "the returned node's sandbox to be running again", func() bool { return state(lost.ID) == catalog.StateRunning })
}

// TestLostNodeRestore: with store.export_on_pause, a paused runc sandbox's
// snapshot is exported as it pauses. When its node is lost, a running
// sandbox there is marked failed (the control: it had no exported
// snapshot) and a connect to it says the node was lost, while the paused
// one stays paused; its resume starts it on the other node under the same
// ID with its file, and the exported snapshot leaves the store. When the
// lost node comes back, its stale copy of the moved sandbox is destroyed
// and the failed one runs again.
func TestLostNodeRestore(t *testing.T) {
	srv := objstoretest.Start(t)
	store := fmt.Sprintf("[store]\nendpoint = %q\nbucket = %q\naccess_key_file = %q\nsecret_key_file = %q\n",
		srv.Endpoint, srv.Bucket, srv.AccessKeyFile, srv.SecretKeyFile)
	m := mastertest.StartMaster(t, "[nodes]\nunhealthy_after = \"2s\"\nlost_after = \"2s\"\n[store]\nexport_on_pause = true\n")
	n1 := mastertest.StartNodeConfig(t, m, noVM+store, "busybox")
	n2 := mastertest.StartNodeConfig(t, m, noVM+store, "busybox")
	m.WaitHealthy(t, n1, n2)
	svc := m.Server.Service
	ctx := context.Background()
	st, err := objstore.Open(objstore.Config{Endpoint: srv.Endpoint, Bucket: srv.Bucket, AccessKeyFile: srv.AccessKeyFile, SecretKeyFile: srv.SecretKeyFile})
	if err != nil {
		t.Fatal(err)
	}

	if _, err := svc.SetSchedulable(ctx, n2.ID, false); err != nil {
		t.Fatal(err)
	}
	var running, paused *catalog.Sandbox
	for i := range 2 {
		sb, err := svc.Create(ctx, master.CreateRequest{Template: "busybox", Timeout: 10 * time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = svc.Kill(context.Background(), sb.ID) })
		if sb.NodeID != n1.ID {
			t.Fatalf("created on %s, want %s", sb.NodeID, n1.ID)
		}
		if i == 0 {
			running = sb
		} else {
			paused = sb
		}
	}
	if _, err := svc.SetSchedulable(ctx, n2.ID, true); err != nil {
		t.Fatal(err)
	}
	want := []byte("paused on " + n1.ID + "\n")
	p := filepath.Join(n1.Env.Config.SandboxRunDir(paused.ID), "rootfs", "data", "note")
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, want, 0o644); err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	if err := svc.Pause(ctx, paused.ID); err != nil {
		t.Fatal(err)
	}
	t.Logf("pause with export (runc, busybox): %s", time.Since(began).Round(time.Millisecond))
	row, err := svc.Get(ctx, paused.ID)
	if err != nil || row.PauseSnapshot == "" {
		t.Fatalf("paused sandbox without an exported snapshot: %+v %v", row, err)
	}
	if ids, err := st.List(ctx); err != nil || len(ids) != 1 || ids[0] != row.PauseSnapshot {
		t.Fatalf("store holds %v (%v), want the pause snapshot %s", ids, err, row.PauseSnapshot)
	}
	if sns, _ := n1.Svc.ListSnapshots(ctx, cubelet.SnapshotFilter{}); len(sns) != 0 {
		t.Errorf("the pause snapshot's copy left on the node: %d", len(sns))
	}

	state := func(id string) string {
		sb, err := svc.Get(ctx, id)
		if err != nil {
			return err.Error()
		}
		return sb.State
	}
	lost := time.Now()
	n1.Stop() // heartbeats stop
	mastertest.WaitFor(t, 15*time.Second, "the lost node's running sandbox to be failed", func() bool { return state(running.ID) == catalog.StateFailed })
	t.Logf("running sandbox on the lost node failed %s after its heartbeats stopped", time.Since(lost).Round(time.Millisecond))
	time.Sleep(time.Second) // a few more passes of the lost loop
	if s := state(paused.ID); s != catalog.StatePaused {
		t.Fatalf("paused sandbox with an exported snapshot on the lost node is %q, want paused", s)
	}
	_, _, err = svc.Connect(ctx, running.ID, time.Minute)
	t.Logf("connect to the lost running sandbox: %v", err)
	if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "lost") {
		t.Errorf("connect to the lost running sandbox: %v, want FailedPrecondition saying its node was lost", err)
	}

	began = time.Now()
	up, resumed, err := svc.Connect(ctx, paused.ID, time.Minute)
	if err != nil || !resumed {
		t.Fatalf("connect to the paused sandbox of the lost node: %v (resumed %v)", err, resumed)
	}
	t.Logf("restore on another node from the snapshot exported at pause (import, clone under the same ID, agent up): %s", time.Since(began).Round(time.Millisecond))
	if up.ID != paused.ID || up.NodeID != n2.ID || up.State != catalog.StateRunning || up.PauseSnapshot != "" {
		t.Fatalf("after the restore: %+v", up)
	}
	got, err := os.ReadFile(filepath.Join(n2.Env.Config.SandboxRunDir(paused.ID), "rootfs", "data", "note"))
	if err != nil || string(got) != string(want) {
		t.Fatalf("file after the restore: %q %v, want %q", got, err, want)
	}
	// Deleted from the store once the restore answered, in the
	// background.
	mastertest.WaitFor(t, 20*time.Second, "the pause snapshot to go from the store after the restore", func() bool {
		ids, err := st.List(ctx)
		return err == nil && len(ids) == 0
	})

	// The lost node returns: its copy of the restored sandbox goes, the
	// failed one runs again.
	n1.Start()
	m.WaitHealthy(t, n1)
	mastertest.WaitFor(t, 20*time.Second, "the returned node to drop its copy of the restored sandbox", func() bool {
		_, err := n1.Svc.Get(ctx, paused.ID)
		return errdefs.IsNotFound(err)
	})
	mastertest.WaitFor(t, 20*time.Second, "the returned node's running sandbox to be running again", func() bool { return state(running.ID) == catalog.StateRunning })
	if sb, err := svc.Get(ctx, paused.ID); err != nil || sb.NodeID != n2.ID || sb.State != catalog.StateRunning {
		t.Errorf("restored sandbox after the node returned: %+v %v", sb, err)
	}
}
