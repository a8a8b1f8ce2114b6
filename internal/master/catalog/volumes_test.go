package catalog_test

import (
	"errors"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// testVolumes: a volume belongs to its team (another team's ID or name
// finds nothing, and the same name is free in another team), a claim is a
// compare-and-swap on the holder (the second of two claims from the same
// holder loses), the node is recorded once, a held volume is not deleted,
// and a team with a volume is not deleted.
func testVolumes(t *testing.T, c *catalog.Catalog) {
	for _, team := range []string{"va", "vb"} {
		if err := c.CreateTeam(ctx, &catalog.Team{Name: team, CreatedAt: time.Now()}); err != nil {
			t.Fatal(err)
		}
	}
	t0 := time.UnixMilli(1_700_000_000_000).UTC()
	v := &catalog.Volume{ID: "vol-a", Team: "va", Name: "data", SizeMiB: 64, Token: "tok", CreatedAt: t0}
	if err := c.CreateVolume(ctx, v); err != nil {
		t.Fatal(err)
	}
	if err := c.CreateVolume(ctx, &catalog.Volume{ID: "vol-a2", Team: "va", Name: "data", SizeMiB: 64, Token: "t", CreatedAt: t0}); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("same team, same name: %v, want AlreadyExists", err)
	}
	if err := c.CreateVolume(ctx, &catalog.Volume{ID: "vol-b", Team: "vb", Name: "data", SizeMiB: 8, Token: "t", CreatedAt: t0}); err != nil {
		t.Fatalf("another team, same name: %v", err)
	}
	if _, err := c.GetVolume(ctx, "vb", "vol-a"); !errdefs.IsNotFound(err) {
		t.Fatalf("team vb gets team va's volume: %v, want NotFound", err)
	}
	if got, err := c.GetVolumeByName(ctx, "vb", "data"); err != nil || got.ID != "vol-b" {
		t.Fatalf("team vb's name resolves to %+v, %v; want its own vol-b", got, err)
	}
	got, err := c.GetVolume(ctx, "va", "vol-a")
	if err != nil || got.Name != "data" || got.SizeMiB != 64 || got.Token != "tok" || !got.CreatedAt.Equal(t0) || got.NodeID != "" || got.SandboxID != "" {
		t.Fatalf("get: %+v, %v", got, err)
	}
	if l, err := c.ListVolumes(ctx, "va"); err != nil || len(l) != 1 || l[0].ID != "vol-a" {
		t.Fatalf("list va: %v, %v", l, err)
	}

	if ok, err := c.ClaimVolume(ctx, "vol-a", "", "sb1", "/data"); err != nil || !ok {
		t.Fatalf("first claim: %v %v", ok, err)
	}
	if ok, err := c.ClaimVolume(ctx, "vol-a", "", "sb2", "/x"); err != nil || ok {
		t.Fatalf("second claim from the same holder won: %v %v", ok, err)
	}
	if held, err := c.SandboxVolumes(ctx, "va", "sb1"); err != nil || len(held) != 1 || held[0].ID != "vol-a" || held[0].MountPath != "/data" {
		t.Fatalf("sb1 holds %+v, %v", held, err)
	}
	if held, err := c.SandboxVolumes(ctx, "vb", "sb1"); err != nil || len(held) != 0 {
		t.Fatalf("team vb sees sb1 hold %+v, %v", held, err)
	}
	if err := c.DeleteVolume(ctx, "va", "vol-a", ""); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("delete of a held volume: %v, want FailedPrecondition", err)
	}
	if node, err := c.PlaceVolume(ctx, "vol-a", "n1"); err != nil || node != "n1" {
		t.Fatalf("place: %q %v", node, err)
	}
	if node, err := c.PlaceVolume(ctx, "vol-a", "n2"); err != nil || node != "n1" {
		t.Fatalf("a second place moved it: %q %v, want n1", node, err)
	}
	if err := c.ReleaseVolumes(ctx, "sb1"); err != nil {
		t.Fatal(err)
	}
	if got, _ := c.GetVolume(ctx, "va", "vol-a"); got.SandboxID != "" || got.MountPath != "" {
		t.Fatalf("after release: holder %q", got.SandboxID)
	}

	if _, err := c.DeleteTeam(ctx, "va"); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("delete of a team with a volume: %v, want FailedPrecondition", err)
	}
	if err := c.DeleteVolume(ctx, "vb", "vol-a", ""); !errdefs.IsNotFound(err) {
		t.Fatalf("team vb deletes team va's volume: %v, want NotFound", err)
	}
	if err := c.DeleteVolume(ctx, "va", "vol-a", ""); err != nil {
		t.Fatal(err)
	}
	if _, err := c.DeleteTeam(ctx, "va"); err != nil {
		t.Fatalf("delete of the team once its volume is gone: %v", err)
	}
}
