package catalog_test

import (
	"errors"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// testSecrets: secrets are per team (one team's name does not find
// another's row), a name is unique within its team only, a replace
// changes the sealed value and its time, and deleting a team deletes its
// secrets (a team made again under the name inherits nothing).
func testSecrets(t *testing.T, c *catalog.Catalog) {
	if err := c.CreateTeam(ctx, &catalog.Team{Name: "ta", CreatedAt: time.Now()}); err != nil {
		t.Fatal(err)
	}
	t0 := time.UnixMilli(1_700_000_000_000).UTC()
	put := func(team, name, sealed string) error {
		return c.CreateSecret(ctx, &catalog.Secret{Team: team, Name: name, KeyID: "k1", Sealed: sealed, CreatedAt: t0, UpdatedAt: t0})
	}
	if err := put("ta", "openai", "v1:AAA"); err != nil {
		t.Fatal(err)
	}
	if err := put("ta", "openai", "v1:BBB"); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("same team, same name: %v, want AlreadyExists", err)
	}
	if err := put(catalog.DefaultTeam, "openai", "v1:CCC"); err != nil {
		t.Fatalf("another team, same name: %v", err)
	}
	if _, err := c.GetSecret(ctx, "tb", "openai"); !errdefs.IsNotFound(err) {
		t.Fatalf("a team without it: %v, want NotFound", err)
	}
	s, err := c.GetSecret(ctx, "ta", "openai")
	if err != nil || s.Sealed != "v1:AAA" || s.KeyID != "k1" || !s.CreatedAt.Equal(t0) {
		t.Fatalf("get: %+v, %v", s, err)
	}
	t1 := t0.Add(time.Hour)
	if err := c.ReplaceSecret(ctx, &catalog.Secret{Team: "ta", Name: "openai", KeyID: "k2", Sealed: "v1:DDD", UpdatedAt: t1}); err != nil {
		t.Fatal(err)
	}
	if err := c.ReplaceSecret(ctx, &catalog.Secret{Team: "tb", Name: "openai", KeyID: "k2", Sealed: "v1:EEE", UpdatedAt: t1}); !errdefs.IsNotFound(err) {
		t.Fatalf("replace in a team without it: %v, want NotFound", err)
	}
	if s, _ := c.GetSecret(ctx, "ta", "openai"); s.Sealed != "v1:DDD" || s.KeyID != "k2" || !s.UpdatedAt.Equal(t1) || !s.CreatedAt.Equal(t0) {
		t.Fatalf("after replace: %+v", s)
	}
	if l, err := c.ListSecrets(ctx, "ta"); err != nil || len(l) != 1 || l[0].Name != "openai" {
		t.Fatalf("list: %v, %v", l, err)
	}
	if err := c.DeleteSecret(ctx, "tb", "openai"); !errdefs.IsNotFound(err) {
		t.Fatalf("delete in a team without it: %v, want NotFound", err)
	}
	if _, err := c.DeleteTeam(ctx, "ta"); err != nil {
		t.Fatal(err)
	}
	if err := c.CreateTeam(ctx, &catalog.Team{Name: "ta", CreatedAt: time.Now()}); err != nil {
		t.Fatal(err)
	}
	if l, err := c.ListSecrets(ctx, "ta"); err != nil || len(l) != 0 {
		t.Fatalf("a team made again under a deleted one's name lists %v, %v", l, err)
	}
	if _, err := c.GetSecret(ctx, catalog.DefaultTeam, "openai"); err != nil {
		t.Fatalf("another team's secret went with the deleted team: %v", err)
	}
	if err := c.DeleteSecret(ctx, catalog.DefaultTeam, "openai"); err != nil {
		t.Fatal(err)
	}
}
