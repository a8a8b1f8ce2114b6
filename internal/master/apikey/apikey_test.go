package apikey_test

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/apikey"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

func TestKeys(t *testing.T) {
	ctx := context.Background()
	cat, err := catalog.Open(ctx, catalog.SQLite, filepath.Join(t.TempDir(), "c.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer cat.Close()
	keys := apikey.New(cat, time.Minute, nil)

	key, secret, err := keys.Create(ctx, "ci", "", false)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(secret, apikey.Prefix) || len(secret) != 44 || !strings.HasPrefix(secret, key.Prefix) {
		t.Fatalf("secret %q prefix %q", secret, key.Prefix)
	}
	// Only the hash is stored.
	stored, _ := cat.ListAPIKeys(ctx)
	if len(stored) != 1 || stored[0].Hash != apikey.Hash(secret) || strings.Contains(stored[0].Hash, secret[4:]) {
		t.Fatalf("stored: %+v", stored)
	}
	if _, _, err := keys.Create(ctx, "ci", "", false); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("duplicate name: %v", err)
	}
	if _, _, err := keys.Create(ctx, "bad name!", "", false); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("bad name: %v", err)
	}

	got, err := keys.Verify(ctx, secret)
	if err != nil || got.ID != key.ID {
		t.Fatalf("verify: %+v %v", got, err)
	}
	if stored, _ := cat.ListAPIKeys(ctx); stored[0].LastUsedAt.IsZero() {
		t.Fatal("last use not recorded")
	}
	wrong := secret[:len(secret)-1] + map[bool]string{true: "0", false: "1"}[secret[len(secret)-1] != '0']
	for _, bad := range []string{"", "e2b_", "nope", wrong, strings.ToUpper(secret), secret + "0"} {
		if _, err := keys.Verify(ctx, bad); !errors.Is(err, apikey.ErrUnauthenticated) {
			t.Errorf("verify %q: %v", bad, err)
		}
	}

	// Revocation takes effect at once, even though the key was cached.
	if _, err := keys.Delete(ctx, key.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := keys.Verify(ctx, secret); !errors.Is(err, apikey.ErrUnauthenticated) {
		t.Fatalf("revoked key still accepted: %v", err)
	}
	if _, err := keys.Delete(ctx, key.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("delete twice: %v", err)
	}

	// A closed store is a server error, not a 401.
	_, secret2, _ := keys.Create(ctx, "other", "", true)
	cat.Close()
	if _, err := apikey.New(cat, time.Minute, nil).Verify(ctx, secret2); err == nil || errors.Is(err, apikey.ErrUnauthenticated) {
		t.Fatalf("store down: %v", err)
	}
}
