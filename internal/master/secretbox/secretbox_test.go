package secretbox_test

import (
	"bytes"
	"encoding/base64"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/master/secretbox"
)

// TestLoad: the first Load makes the key file (0600, in a 0700 directory)
// and a second Load of the same file opens what the first sealed; a key
// file others can read is refused, and so is a malformed one.
func TestLoad(t *testing.T) {
	path := filepath.Join(t.TempDir(), "sub", "secrets.key")
	a, err := secretbox.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Fatalf("key file mode %v, want 0600", fi.Mode().Perm())
	}
	if di, _ := os.Stat(filepath.Dir(path)); di.Mode().Perm() != 0o700 {
		t.Fatalf("key directory mode %v, want 0700", di.Mode().Perm())
	}
	sealed := a.Seal([]byte("team\x00name"), []byte("Bearer sk-1"))
	b, err := secretbox.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	if a.KeyID() != b.KeyID() {
		t.Fatalf("key id changed across loads: %s, %s", a.KeyID(), b.KeyID())
	}
	if v, err := b.Open([]byte("team\x00name"), sealed); err != nil || string(v) != "Bearer sk-1" {
		t.Fatalf("reopened: %q, %v", v, err)
	}

	if err := os.Chmod(path, 0o640); err != nil {
		t.Fatal(err)
	}
	if _, err := secretbox.Load(path); err == nil || !strings.Contains(err.Error(), "want 0600") {
		t.Fatalf("group-readable key file: %v, want refused", err)
	}
	bad := filepath.Join(t.TempDir(), "bad.key")
	if err := os.WriteFile(bad, []byte("not hex\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := secretbox.Load(bad); err == nil {
		t.Fatal("malformed key file loaded")
	}
}

// TestSeal: a sealed value holds no trace of the clear one, differs at
// every seal (random nonce), and opens only with the same key and
// context; altered ciphertext does not open. Each refusal has its
// control: the same value, key and context untouched open.
func TestSeal(t *testing.T) {
	box := mustBox(t, 1)
	other := mustBox(t, 2)
	ctx := []byte("team-a\x00openai")
	secret := []byte("Bearer sk-live-0123456789")
	s1, s2 := box.Seal(ctx, secret), box.Seal(ctx, secret)
	if s1 == s2 {
		t.Fatal("two seals of one value are equal (nonce reused)")
	}
	if strings.Contains(s1, string(secret)) || bytes.Contains([]byte(s1), []byte("sk-live")) {
		t.Fatalf("sealed value holds the clear one: %s", s1)
	}
	if v, err := box.Open(ctx, s1); err != nil || !bytes.Equal(v, secret) {
		t.Fatalf("control: %q, %v", v, err)
	}
	if _, err := box.Open([]byte("team-b\x00openai"), s1); err == nil {
		t.Fatal("opened under another team's context")
	}
	if _, err := other.Open(ctx, s1); err == nil || !strings.Contains(err.Error(), other.KeyID()) {
		t.Fatalf("opened under another key: %v", err)
	}
	raw, err := base64.RawStdEncoding.DecodeString(strings.TrimPrefix(s1, "v1:"))
	if err != nil {
		t.Fatal(err)
	}
	raw[len(raw)-20] ^= 1 // a ciphertext byte (the tag is the last 16)
	if _, err := box.Open(ctx, "v1:"+base64.RawStdEncoding.EncodeToString(raw)); err == nil || !strings.Contains(err.Error(), "does not open") {
		t.Fatalf("altered ciphertext: %v, want refused", err)
	}
	if _, err := secretbox.New(make([]byte, 16)); err == nil {
		t.Fatal("a 16-byte key accepted")
	}
}

func mustBox(t *testing.T, fill byte) *secretbox.Box {
	t.Helper()
	b, err := secretbox.New(bytes.Repeat([]byte{fill}, 32))
	if err != nil {
		t.Fatal(err)
	}
	return b
}
