package store

import (
	"encoding/json"
	"fmt"
	"sort"

	bolt "go.etcd.io/bbolt"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/sandbox"
)

var bucketSnapshots = []byte("snapshots")

// CreateSnapshot inserts a snapshot record; an existing ID is
// ErrAlreadyExists. Callers write it (State creating) before any file.
func (s *Store) CreateSnapshot(sn *sandbox.Snapshot) error {
	data, err := json.Marshal(sn) //nolint:gosec // G117: the node keeps the agent token to call the agent after a restart; the store file is root-only (0600)
	if err != nil {
		return err
	}
	return s.batch(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketSnapshots)
		if b.Get([]byte(sn.ID)) != nil {
			return fmt.Errorf("snapshot %q: %w", sn.ID, errdefs.ErrAlreadyExists)
		}
		return b.Put([]byte(sn.ID), data)
	})
}

// PutSnapshot writes a snapshot record, replacing any previous version.
func (s *Store) PutSnapshot(sn *sandbox.Snapshot) error { return put(s, bucketSnapshots, sn.ID, sn) }

// GetSnapshot reads one snapshot; absent is ErrNotFound.
func (s *Store) GetSnapshot(id string) (*sandbox.Snapshot, error) {
	return get[sandbox.Snapshot](s, bucketSnapshots, "snapshot", id)
}

// ListSnapshots returns every snapshot record (any state), oldest first.
func (s *Store) ListSnapshots() ([]*sandbox.Snapshot, error) {
	out, err := list[sandbox.Snapshot](s, bucketSnapshots)
	sort.Slice(out, func(i, j int) bool {
		if out[i].CreatedAt.Equal(out[j].CreatedAt) {
			return out[i].ID < out[j].ID
		}
		return out[i].CreatedAt.Before(out[j].CreatedAt)
	})
	return out, err
}

// DeleteSnapshot removes a snapshot record; absent is not an error.
func (s *Store) DeleteSnapshot(id string) error { return del(s, bucketSnapshots, id) }
