// Package apikey issues and checks the API keys clients send as X-API-Key.
//
// A key is "e2b_" followed by 40 hex characters (160 random bits), shaped
// like E2B's so tools that sniff the prefix accept it. Only its SHA-256 is
// stored: a fast hash is right for a high-entropy secret (there is nothing
// to brute-force), and it lets the catalog index keys by hash. The stored
// hash is still compared in constant time after the lookup.
package apikey

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// Prefix starts every key.
const Prefix = "e2b_"

// Store is the part of the catalog keys live in.
type Store interface {
	CreateAPIKey(ctx context.Context, k *catalog.APIKey) error
	APIKeyByHash(ctx context.Context, hash string) (*catalog.APIKey, error)
	ListAPIKeys(ctx context.Context) ([]*catalog.APIKey, error)
	DeleteAPIKey(ctx context.Context, idOrName string) (*catalog.APIKey, error)
	TouchAPIKey(ctx context.Context, id string, t time.Time) error
}

// ErrUnauthenticated is returned for a missing, malformed or unknown key.
// The HTTP edge answers it with 401.
var ErrUnauthenticated = errors.New("invalid or missing API key")

// Hash is the hex SHA-256 of a secret.
func Hash(secret string) string {
	sum := sha256.Sum256([]byte(secret))
	return hex.EncodeToString(sum[:])
}

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err) // crypto/rand does not fail on Linux
	}
	return hex.EncodeToString(b)
}

var nameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

// Keys issues and verifies keys. Verified keys are cached briefly so a busy
// client does not cost a query per request; deleting a key drops it from
// this process's cache at once (other master replicas see it within the
// cache TTL).
type Keys struct {
	store Store
	ttl   time.Duration
	log   *slog.Logger

	mu    sync.Mutex
	cache map[string]cached // by hash
}

type cached struct {
	key     *catalog.APIKey
	expires time.Time
	touched time.Time
}

// New returns a Keys over store; ttl bounds how long a verified key is
// trusted without asking the store again.
func New(store Store, ttl time.Duration, log *slog.Logger) *Keys {
	if log == nil {
		log = slog.Default()
	}
	return &Keys{store: store, ttl: ttl, log: log, cache: map[string]cached{}}
}

// Create issues a new key named name for team ("": the default team; it
// must exist), an admin key when admin, and returns it with its secret,
// which is never stored and cannot be shown again.
func (k *Keys) Create(ctx context.Context, name, team string, admin bool) (*catalog.APIKey, string, error) {
	if !nameRE.MatchString(name) {
		return nil, "", fmt.Errorf("api key name %q: 1-128 letters, digits, '.', '_' or '-': %w", name, errdefs.ErrInvalidArgument)
	}
	secret := Prefix + randomHex(20)
	key := &catalog.APIKey{
		ID: "key_" + randomHex(8), Name: name, Prefix: secret[:len(Prefix)+6],
		Hash: Hash(secret), CreatedAt: time.Now().UTC(), Admin: admin, Team: team,
	}
	if err := k.store.CreateAPIKey(ctx, key); err != nil {
		return nil, "", err
	}
	return key, secret, nil
}

// List returns every key's metadata.
func (k *Keys) List(ctx context.Context) ([]*catalog.APIKey, error) { return k.store.ListAPIKeys(ctx) }

// Delete revokes the key with this ID or name.
func (k *Keys) Delete(ctx context.Context, idOrName string) (*catalog.APIKey, error) {
	key, err := k.store.DeleteAPIKey(ctx, idOrName)
	if err != nil {
		return nil, err
	}
	k.mu.Lock()
	delete(k.cache, key.Hash)
	k.mu.Unlock()
	return key, nil
}

// Forget drops keys the store deleted by other means (a team's delete)
// from this process's cache.
func (k *Keys) Forget(keys ...*catalog.APIKey) {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, key := range keys {
		delete(k.cache, key.Hash)
	}
}

var secretRE = regexp.MustCompile(`^` + Prefix + `[0-9a-f]{40}$`)

// Verify returns the key a presented secret belongs to, or
// ErrUnauthenticated. Store failures are returned as they are (the caller
// answers 500, not 401).
func (k *Keys) Verify(ctx context.Context, secret string) (*catalog.APIKey, error) {
	secret = strings.TrimSpace(secret)
	if !secretRE.MatchString(secret) {
		return nil, ErrUnauthenticated
	}
	h := Hash(secret)
	now := time.Now()
	k.mu.Lock()
	c, ok := k.cache[h]
	k.mu.Unlock()
	if ok && now.Before(c.expires) {
		k.touch(c, now)
		return c.key, nil
	}
	key, err := k.store.APIKeyByHash(ctx, h)
	if errdefs.IsNotFound(err) {
		return nil, ErrUnauthenticated
	}
	if err != nil {
		return nil, fmt.Errorf("api key lookup: %w", err)
	}
	if subtle.ConstantTimeCompare([]byte(key.Hash), []byte(h)) != 1 {
		return nil, ErrUnauthenticated
	}
	c = cached{key: key, expires: now.Add(k.ttl)}
	k.touch(c, now)
	return key, nil
}

// touch records last use at most once a minute per key, off the request
// path's critical section.
func (k *Keys) touch(c cached, now time.Time) {
	k.mu.Lock()
	stale := now.Sub(c.touched) > time.Minute
	if stale {
		c.touched = now
	}
	k.cache[c.key.Hash] = c
	k.mu.Unlock()
	if stale {
		if err := k.store.TouchAPIKey(context.Background(), c.key.ID, now); err != nil {
			k.log.Warn("record api key use", "key_id", c.key.ID, "err", err)
		}
	}
}
