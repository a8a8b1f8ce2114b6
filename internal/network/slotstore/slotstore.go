// Package slotstore is network-agent's durable state: one record per slot
// in a bbolt file of its own, keyed by slot number.
//
// Invariant: a slot's record is written BEFORE any of its kernel objects
// is made, and deleted only AFTER they are all gone, so after a crash at
// any instant the store names every slot that may exist in the kernel.
package slotstore

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/policy"
)

// State is where a slot is in its life:
//
//	creating ──► ready ──► assigned ──► releasing ──► (record deleted)
//	    │          (pooled)   ▲             ▲
//	    └──────────────────────┴─────────────┘  (cold create for a sandbox;
//	                                              a failed create releases)
type State string

const (
	Creating  State = "creating"  // kernel objects may be half made
	Ready     State = "ready"     // complete, in the pool, deny-all policy
	Assigned  State = "assigned"  // belongs to SandboxID, its policy applied
	Releasing State = "releasing" // being torn down
)

// Record is one slot.
type Record struct {
	Index      int           `json:"index"`
	Kind       network.Kind  `json:"kind"`
	State      State         `json:"state"`
	SandboxID  string        `json:"sandbox_id,omitempty"`
	Policy     policy.Policy `json:"policy"`
	FromPool   bool          `json:"from_pool,omitempty"`
	CreatedAt  time.Time     `json:"created_at"`
	AssignedAt time.Time     `json:"assigned_at,omitzero"`
}

// Clone returns a deep copy.
func (r *Record) Clone() *Record {
	c := *r
	c.Policy = r.Policy.Clone()
	return &c
}

var (
	bucketSlots = []byte("slots")
	bucketMeta  = []byte("meta")
)

// Store is safe for concurrent use.
type Store struct{ db *bolt.DB }

// Open opens (creating if needed) the store at path. A second agent on the
// same file fails fast.
func Open(path string) (*Store, error) {
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 2 * time.Second})
	if err != nil {
		return nil, fmt.Errorf("open slot store %s: %w", path, err)
	}
	// Concurrent ensures (a burst of creates) coalesce their fsyncs.
	db.MaxBatchDelay = 2 * time.Millisecond
	err = db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bucketSlots, bucketMeta} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("init slot store: %w", err)
	}
	return &Store{db: db}, nil
}

// Close closes the file.
func (s *Store) Close() error { return s.db.Close() }

func key(i int) []byte {
	var b [4]byte
	binary.BigEndian.PutUint32(b[:], uint32(i))
	return b[:]
}

// Put writes r durably.
func (s *Store) Put(r *Record) error {
	data, err := json.Marshal(r)
	if err != nil {
		return err
	}
	return s.db.Batch(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketSlots).Put(key(r.Index), data)
	})
}

// Delete removes slot i's record; a missing one is not an error.
func (s *Store) Delete(i int) error {
	return s.db.Batch(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketSlots).Delete(key(i))
	})
}

// List returns every record, by slot number.
func (s *Store) List() ([]*Record, error) {
	var out []*Record
	err := s.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketSlots).ForEach(func(k, v []byte) error {
			var r Record
			if err := json.Unmarshal(v, &r); err != nil {
				return fmt.Errorf("slot %x: %w", k, err)
			}
			out = append(out, &r)
			return nil
		})
	})
	return out, err
}

// Meta returns a metadata value ("" when unset).
func (s *Store) Meta(k string) (string, error) {
	var v string
	err := s.db.View(func(tx *bolt.Tx) error {
		v = string(tx.Bucket(bucketMeta).Get([]byte(k)))
		return nil
	})
	return v, err
}

// SetMeta writes a metadata value.
func (s *Store) SetMeta(k, v string) error {
	if k == "" {
		return errors.New("slotstore: empty meta key")
	}
	return s.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketMeta).Put([]byte(k), []byte(v))
	})
}
