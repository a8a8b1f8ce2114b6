package master_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/mastertest"
)

// TestVolumesNodeLocal runs one master over two cubelets: a volume lives
// on the node its first sandbox was placed on, later sandboxes mounting
// it go there (with that node cordoned, a create without the volume lands
// on the other node, the control, while one with it is refused naming the
// node), one sandbox holds it at a time, a held volume is not deleted,
// and a delete removes its image from the node.
func TestVolumesNodeLocal(t *testing.T) {
	m := mastertest.StartMaster(t, "")
	a := mastertest.StartNode(t, m, "busybox")
	b := mastertest.StartNode(t, m, "busybox")
	m.WaitHealthy(t, a, b)
	nodes := map[string]*mastertest.Node{a.ID: a, b.ID: b}
	ctx := master.WithTeam(context.Background(), catalog.DefaultTeam)
	svc := m.Server.Service
	create := func(vols ...master.VolumeMount) (*catalog.Sandbox, error) {
		return svc.Create(ctx, master.CreateRequest{Template: "busybox", Timeout: 10 * time.Minute, Volumes: vols})
	}
	kill := func(sb *catalog.Sandbox) {
		t.Helper()
		if err := svc.Kill(ctx, sb.ID); err != nil {
			t.Fatal(err)
		}
	}
	v, err := svc.CreateVolume(ctx, "data", 8)
	if err != nil {
		t.Fatal(err)
	}
	mount := master.VolumeMount{Name: "data", Path: "/data"}

	first, err := create(mount)
	if err != nil {
		t.Fatal(err)
	}
	home := first.NodeID
	other := a.ID
	if home == a.ID {
		other = b.ID
	}
	if got, _ := svc.GetVolume(ctx, v.ID); got.NodeID != home {
		t.Fatalf("volume recorded on %q, its first sandbox runs on %q", got.NodeID, home)
	}
	img := filepath.Join(nodes[home].Env.Config.Node.DataDir, "pool", "volumes", v.ID, "volume.img")
	if _, err := os.Stat(img); err != nil {
		t.Fatalf("image on the volume's node: %v", err)
	}

	_, err = create(mount)
	t.Logf("a second sandbox mounting the held volume: %v", err)
	if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), first.ID) {
		t.Fatalf("second holder: %v, want FailedPrecondition naming %s", err, first.ID)
	}
	err = svc.DeleteVolume(ctx, v.ID)
	t.Logf("delete of the held volume: %v", err)
	if !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("delete while held: %v, want FailedPrecondition", err)
	}
	kill(first)

	if _, err := m.Admin.SetNodeSchedulable(ctx, &masterpb.SetNodeSchedulableRequest{NodeId: home, Schedulable: false}); err != nil {
		t.Fatal(err)
	}
	control, err := create()
	if err != nil || control.NodeID != other {
		t.Fatalf("control: a create without the volume with %s cordoned: %v on %q", home, err, control.NodeID)
	}
	kill(control)
	_, err = create(mount)
	t.Logf("with the volume's node cordoned: %v", err)
	if err == nil || !strings.Contains(err.Error(), home) {
		t.Fatalf("with the volume's node cordoned: %v, want a refusal naming %s", err, home)
	}
	if _, err := m.Admin.SetNodeSchedulable(ctx, &masterpb.SetNodeSchedulableRequest{NodeId: home, Schedulable: true}); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		sb, err := create(mount)
		if err != nil {
			t.Fatal(err)
		}
		if sb.NodeID != home {
			t.Fatalf("a sandbox with the volume placed on %s, the volume lives on %s", sb.NodeID, home)
		}
		kill(sb)
	}

	// A sandbox holding a volume cannot move (the volume stays on its
	// node): a drain of that node is refused, nothing changed; the
	// control is the same drain once the sandbox is gone.
	held, err := create(mount)
	if err != nil {
		t.Fatal(err)
	}
	err = svc.Drain(ctx, home, master.DrainOptions{}, nil)
	t.Logf("drain of the node of a sandbox holding a volume: %v", err)
	if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "node-local") || !strings.Contains(err.Error(), held.ID) {
		t.Fatalf("drain with a volume holder: %v, want FailedPrecondition naming %s and the volume", err, held.ID)
	}
	if got, _ := svc.Get(ctx, held.ID); got == nil || got.NodeID != home || got.State != catalog.StateRunning {
		t.Fatalf("after the refused drain the holder is %+v, want running on %s", got, home)
	}
	kill(held)
	if err := svc.Drain(ctx, home, master.DrainOptions{}, nil); err != nil {
		t.Fatalf("control: the drain once the holder is gone: %v", err)
	}
	if _, err := m.Admin.SetNodeSchedulable(ctx, &masterpb.SetNodeSchedulableRequest{NodeId: home, Schedulable: true}); err != nil {
		t.Fatal(err)
	}

	// A delete in progress holds the volume: a create meanwhile is
	// refused instead of claiming it and mounting an image the delete is
	// removing. The mark is what DeleteVolume writes, set here through a
	// second connection to the catalog (as another replica would); the
	// control is the same create once the mark is gone.
	cat, err := catalog.Open(ctx, m.Config.Catalog.Driver, m.Config.Catalog.DSN)
	if err != nil {
		t.Fatal(err)
	}
	defer cat.Close()
	mark := func(to string) {
		t.Helper()
		cur, err := svc.GetVolume(ctx, v.ID)
		if err != nil {
			t.Fatal(err)
		}
		from := cur.SandboxID // a killed holder's ID stays until the next claim
		if ok, err := cat.ClaimVolume(ctx, v.ID, from, to, ""); err != nil || !ok {
			t.Fatalf("set the volume's holder %q -> %q: %v %v", from, to, ok, err)
		}
	}
	mark("deleting-" + v.ID)
	_, err = create(mount)
	t.Logf("a create while the volume is being deleted: %v", err)
	if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "being deleted") {
		t.Fatalf("create during a delete: %v, want FailedPrecondition (being deleted)", err)
	}
	mark("")
	sb, err := create(mount)
	if err != nil {
		t.Fatalf("control: the same create once the delete's mark is gone: %v", err)
	}
	kill(sb)
	// A delete cut short leaves its mark; the next delete takes over.
	mark("deleting-" + v.ID)
	if err := svc.DeleteVolume(ctx, v.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(img); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("image after delete: %v", err)
	}
	if _, err := svc.GetVolume(ctx, v.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("get after delete: %v", err)
	}
}
