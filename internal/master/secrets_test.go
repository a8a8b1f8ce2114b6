package master

import (
	"context"
	"log/slog"
	"path/filepath"
	"testing"

	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/secretbox"
)

// BenchmarkNodeNetwork is what a rule naming a secret adds to a create:
// the catalog read and the AES-GCM open of nodeNetwork (twice per create:
// the check before placement and the send), against the same policy with
// a literal value (no catalog read).
func BenchmarkNodeNetwork(b *testing.B) {
	ctx := context.Background()
	cat, err := catalog.Open(ctx, catalog.SQLite, filepath.Join(b.TempDir(), "catalog.db"))
	if err != nil {
		b.Fatal(err)
	}
	defer cat.Close()
	box, err := secretbox.Load(filepath.Join(b.TempDir(), "secrets.key"))
	if err != nil {
		b.Fatal(err)
	}
	s := &Service{cat: cat, box: box, log: slog.New(slog.DiscardHandler)}
	if _, err := s.PutSecret(WithTeam(ctx, "default"), "openai", "Bearer sk-0123456789", false); err != nil {
		b.Fatal(err)
	}
	for _, c := range []struct {
		name string
		cred catalog.Credential
	}{
		{"literal", catalog.Credential{Host: "api.openai.com", Header: "Authorization", Value: "Bearer sk-0123456789"}},
		{"secret", catalog.Credential{Host: "api.openai.com", Header: "Authorization", SecretName: "openai"}},
	} {
		n := catalog.Network{AllowOut: []string{"api.openai.com"}, Credentials: []catalog.Credential{c.cred}}
		b.Run(c.name, func(b *testing.B) {
			for b.Loop() {
				p, err := s.nodeNetwork(ctx, "default", n)
				if err != nil || p.Credentials[0].Value != "Bearer sk-0123456789" {
					b.Fatalf("%v %v", p, err)
				}
			}
		})
	}
}
