// Package secretbox seals the secrets cubemaster keeps in its catalog:
// AES-256-GCM under a master key read from a file (made, mode 0600, at
// first start when absent), so the catalog's rows and backups hold
// ciphertext only and a secret is readable only with the key file too.
package secretbox

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// keySize is AES-256's.
const keySize = 32

// version prefixes every sealed value, so a later format can be told apart.
const version = "v1:"

// Box seals and opens values under one master key.
type Box struct {
	aead cipher.AEAD
	id   string
}

// Load reads the key file at path (32 random bytes, hex); when it does not
// exist, it makes one with a fresh key, mode 0600, in a directory made
// 0700. A file readable by others than its owner is refused: the key
// opens every secret of every team.
func Load(path string) (*Box, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return create(path)
	}
	if err != nil {
		return nil, fmt.Errorf("secrets key %s: %w", path, err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("secrets key %s: %w", path, err)
	}
	if fi.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("secrets key %s: mode %v, want 0600 (readable by its owner only): %w", path, fi.Mode().Perm(), errdefs.ErrInvalidArgument)
	}
	key, err := hex.DecodeString(strings.TrimSpace(string(b)))
	if err != nil || len(key) != keySize {
		return nil, fmt.Errorf("secrets key %s: want %d bytes in hex: %w", path, keySize, errdefs.ErrInvalidArgument)
	}
	return New(key)
}

// create writes a new key at path: into a temp file of its directory,
// synced, then linked to path (link fails if path exists, so two masters
// starting at once on one directory cannot each write a different key:
// the loser reads the winner's), and the directory synced. A crash leaves
// either no key file or a whole one, never an empty one that would stop
// the master from starting.
func create(path string) (*Box, error) {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("secrets key: %w", err)
	}
	key := make([]byte, keySize)
	if _, err := rand.Read(key); err != nil {
		return nil, err
	}
	f, err := os.CreateTemp(dir, ".secrets-key-*")
	if err != nil {
		return nil, fmt.Errorf("secrets key: %w", err)
	}
	defer os.Remove(f.Name())
	_, err = f.WriteString(hex.EncodeToString(key) + "\n")
	if err == nil {
		err = f.Chmod(0o600)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, fmt.Errorf("secrets key %s: %w", path, err)
	}
	if err := os.Link(f.Name(), path); errors.Is(err, fs.ErrExist) {
		return Load(path)
	} else if err != nil {
		return nil, fmt.Errorf("secrets key %s: %w", path, err)
	}
	if d, err := os.Open(dir); err == nil {
		err = d.Sync()
		d.Close()
		if err != nil {
			return nil, fmt.Errorf("secrets key %s: sync %s: %w", path, dir, err)
		}
	}
	return New(key)
}

// New returns a Box for a 32-byte key.
func New(key []byte) (*Box, error) {
	if len(key) != keySize {
		return nil, fmt.Errorf("secrets key: %d bytes, want %d: %w", len(key), keySize, errdefs.ErrInvalidArgument)
	}
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, err
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256(append([]byte("cube secrets key id\x00"), key...))
	return &Box{aead: aead, id: hex.EncodeToString(sum[:8])}, nil
}

// KeyID names the key without revealing it (stored beside each sealed
// value, so a value sealed under another key is reported as such).
func (b *Box) KeyID() string { return b.id }

// Seal encrypts plaintext bound to context (e.g. team and name): a sealed
// value copied to another row does not open there.
func (b *Box) Seal(context, plaintext []byte) string {
	nonce := make([]byte, b.aead.NonceSize())
	if _, err := rand.Read(nonce); err != nil {
		panic(err) // crypto/rand never fails on Linux ≥ 3.17
	}
	return version + base64.RawStdEncoding.EncodeToString(b.aead.Seal(nonce, nonce, plaintext, context))
}

// Open decrypts a value Seal returned for the same context.
func (b *Box) Open(context []byte, sealed string) ([]byte, error) {
	rest, ok := strings.CutPrefix(sealed, version)
	if !ok {
		return nil, fmt.Errorf("sealed secret: unknown format: %w", errdefs.ErrInternal)
	}
	raw, err := base64.RawStdEncoding.DecodeString(rest)
	if err != nil || len(raw) < b.aead.NonceSize() {
		return nil, fmt.Errorf("sealed secret: malformed: %w", errdefs.ErrInternal)
	}
	n := b.aead.NonceSize()
	out, err := b.aead.Open(nil, raw[:n], raw[n:], context)
	if err != nil {
		return nil, fmt.Errorf("sealed secret does not open under key %s (altered, moved to another row, or sealed under another key): %w", b.id, errdefs.ErrInternal)
	}
	return out, nil
}
