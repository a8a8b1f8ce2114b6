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
