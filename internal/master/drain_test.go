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
	"github.com/cubesandbox/cube/internal/objstore/objstoretest"
)

// TestDrain: a node holding a running and a paused runc sandbox, each
// with a file written, is drained: both end on the other node under their
// IDs and states, with their files, the running one with the deadline it
// had, and the drained node holds no sandbox. Control: while the other
// node is cordoned no node can take them, and the drain is refused with
// nothing changed (the node still schedulable, both sandboxes in place).
func TestDrain(t *testing.T) {
	srv := objstoretest.Start(t)
	store := fmt.Sprintf("[store]\nendpoint = %q\nbucket = %q\naccess_key_file = %q\nsecret_key_file = %q\n",
		srv.Endpoint, srv.Bucket, srv.AccessKeyFile, srv.SecretKeyFile)
	m := mastertest.StartMaster(t, "")
	n1 := mastertest.StartNodeConfig(t, m, noVM+store, "busybox")
	n2 := mastertest.StartNodeConfig(t, m, noVM+store, "busybox")
	m.WaitHealthy(t, n1, n2)
	svc := m.Server.Service
	ctx := context.Background()

	// A request wait past the bound (the other replicas keep their
	// answers to a quiesce no longer) is refused before anything changes.
	err := svc.Drain(ctx, n1.ID, master.DrainOptions{RequestWait: master.MaxRequestWait + time.Second}, func(master.DrainEvent) {})
	t.Logf("drain with request wait %s: %v", master.MaxRequestWait+time.Second, err)
	if !errdefs.IsInvalidArgument(err) {
		t.Fatalf("drain with a request wait past %s: %v, want InvalidArgument", master.MaxRequestWait, err)
	}

	// Both sandboxes on n1: n2 cordoned for the creates.
	if _, err := svc.SetSchedulable(ctx, n2.ID, false); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = svc.SetSchedulable(context.Background(), n1.ID, true)
		_, _ = svc.SetSchedulable(context.Background(), n2.ID, true)
	})
	ids := map[string]string{} // id -> state it should keep
	files := map[string][]byte{}
	var runningEnd time.Time
	for _, state := range []string{catalog.StateRunning, catalog.StatePaused} {
		sb, err := svc.Create(ctx, master.CreateRequest{Template: "busybox", Timeout: 10 * time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = svc.Kill(context.Background(), sb.ID) })
		if sb.NodeID != n1.ID {
			t.Fatalf("created on %s, want %s", sb.NodeID, n1.ID)
		}
		want := []byte(state + " sandbox " + sb.ID + "\n")
		p := filepath.Join(n1.Env.Config.SandboxRunDir(sb.ID), "rootfs", "data", "note")
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, want, 0o644); err != nil {
			t.Fatal(err)
		}
		if state == catalog.StatePaused {
			began := time.Now()
			if err := svc.Pause(ctx, sb.ID); err != nil {
				t.Fatal(err)
			}
			t.Logf("pause without export (runc, busybox): %s", time.Since(began).Round(time.Millisecond))
		} else {
			runningEnd = sb.EndAt
		}
		ids[sb.ID], files[sb.ID] = state, want
	}

	// Control: n2 cordoned, nothing can take them: refused, unchanged.
	err = svc.Drain(ctx, n1.ID, master.DrainOptions{}, nil)
	t.Logf("drain with no other node schedulable: %v", err)
	if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), n2.ID+": cordoned") {
		t.Fatalf("drain with no node to take the sandboxes: %v, want FailedPrecondition naming %s cordoned", err, n2.ID)
	}
	if v := m.Node(t, n1.ID); !v.Schedulable {
		t.Errorf("a refused drain cordoned %s", n1.ID)
	}
	for id, state := range ids {
		if sb, err := svc.Get(ctx, id); err != nil || sb.NodeID != n1.ID || sb.State != state {
			t.Errorf("after a refused drain, %s: %+v %v", id, sb, err)
		}
	}

	if _, err := svc.SetSchedulable(ctx, n2.ID, true); err != nil {
		t.Fatal(err)
	}
	var events []master.DrainEvent
	began := time.Now()
	if err := svc.Drain(ctx, n1.ID, master.DrainOptions{}, func(ev master.DrainEvent) { events = append(events, ev) }); err != nil {
		t.Fatalf("drain: %v", err)
	}
	t.Logf("drain of %s (a running and a paused runc sandbox) in %s", n1.ID, time.Since(began).Round(time.Millisecond))
	moved := map[string]bool{}
	for _, ev := range events {
		t.Logf("  %s %s %s -> %s took %s left %d/%d %s", ev.SandboxID, ev.State, ev.Phase, ev.To, ev.Took.Round(time.Millisecond), ev.Remaining, ev.Total, ev.Err)
		if ev.Phase == master.DrainMoved && ev.To == n2.ID {
			moved[ev.SandboxID] = true
		}
	}
	if last := events[len(events)-1]; last.Phase != master.DrainDone {
		t.Errorf("last event %+v, want done", last)
	}
	if v := m.Node(t, n1.ID); v.Schedulable {
		t.Errorf("drained node %s is schedulable", n1.ID)
	}
	for id, state := range ids {
		if !moved[id] {
			t.Errorf("no moved event for %s", id)
		}
		sb, err := svc.Get(ctx, id)
		if err != nil || sb.NodeID != n2.ID || sb.State != state {
			t.Fatalf("after the drain, %s: %+v %v, want %s on %s", id, sb, err, state, n2.ID)
		}
		if state == catalog.StateRunning && sb.EndAt.Sub(runningEnd).Abs() > time.Millisecond {
			t.Errorf("running sandbox's deadline %s, want the one it had, %s", sb.EndAt, runningEnd)
		}
		got, err := os.ReadFile(filepath.Join(n2.Env.Config.SandboxRunDir(id), "rootfs", "data", "note"))
		if err != nil || string(got) != string(files[id]) {
			t.Errorf("file of %s on %s: %q %v, want %q", id, n2.ID, got, err, files[id])
		}
		rec, err := n2.Svc.Get(ctx, id)
		if err != nil || !strings.EqualFold(string(rec.State), state) {
			t.Errorf("%s on %s: %v %v, want %s", id, n2.ID, rec, err, state)
		}
	}
	if left, err := n1.Svc.List(ctx, cubelet.ListFilter{}); err != nil || len(left) != 0 {
		t.Errorf("drained node holds %d sandboxes (%v)", len(left), err)
	}
	// The moved sandboxes work: the paused one resumes where it is now.
	for id, state := range ids {
		if state == catalog.StatePaused {
			up, err := svc.Resume(ctx, id, time.Minute)
			if err != nil || up.NodeID != n2.ID {
				t.Errorf("resume of the moved paused sandbox: %+v %v", up, err)
			}
		}
	}
}

// TestDrainWait: with Wait a running sandbox is not moved: the drain
// reports it waiting and ends once the sandbox is killed (reported
// ended), the node cordoned and empty; the sandbox never left its node.
func TestDrainWait(t *testing.T) {
	srv := objstoretest.Start(t)
	store := fmt.Sprintf("[store]\nendpoint = %q\nbucket = %q\naccess_key_file = %q\nsecret_key_file = %q\n",
		srv.Endpoint, srv.Bucket, srv.AccessKeyFile, srv.SecretKeyFile)
	m := mastertest.StartMaster(t, "")
	n1 := mastertest.StartNodeConfig(t, m, noVM+store, "busybox")
	n2 := mastertest.StartNodeConfig(t, m, noVM+store, "busybox")
	m.WaitHealthy(t, n1, n2)
	svc := m.Server.Service
	ctx := context.Background()
	if _, err := svc.SetSchedulable(ctx, n2.ID, false); err != nil {
		t.Fatal(err)
	}
	sb, err := svc.Create(ctx, master.CreateRequest{Template: "busybox", Timeout: 10 * time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = svc.Kill(context.Background(), sb.ID)
		_, _ = svc.SetSchedulable(context.Background(), n1.ID, true)
	})
	if _, err := svc.SetSchedulable(ctx, n2.ID, true); err != nil {
		t.Fatal(err)
	}
	events := make(chan master.DrainEvent, 16)
	done := make(chan error, 1)
	go func() {
		done <- svc.Drain(ctx, n1.ID, master.DrainOptions{Wait: true}, func(ev master.DrainEvent) { events <- ev })
	}()
	if ev := <-events; ev.SandboxID != sb.ID || ev.Phase != master.DrainWaiting {
		t.Fatalf("first event %+v, want %s waiting", ev, sb.ID)
	}
	time.Sleep(time.Second)
	select {
	case err := <-done:
		t.Fatalf("drain with --wait ended while the sandbox ran: %v", err)
	default:
	}
	if cur, err := svc.Get(ctx, sb.ID); err != nil || cur.NodeID != n1.ID || cur.State != "running" {
		t.Fatalf("waited-for sandbox: %+v %v, want running on %s", cur, err, n1.ID)
	}
	if err := svc.Kill(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("drain: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("drain did not end after its last sandbox was killed")
	}
	var phases []string
	for len(events) > 0 {
		ev := <-events
		phases = append(phases, ev.SandboxID+" "+ev.Phase)
	}
	t.Logf("events after waiting: %v", phases)
	if len(phases) != 2 || phases[0] != sb.ID+" "+master.DrainEnded || phases[1] != " "+master.DrainDone {
		t.Errorf("events after waiting: %v, want ended, then done", phases)
	}
}
