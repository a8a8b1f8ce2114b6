// Package store is cubelet's durable state: sandboxes, templates and the
// cleanup journal in one bbolt file. Values are JSON of the typed records
// in package sandbox.
//
// Writes go through a group commit (commit.go) so concurrent creates
// coalesce their fsyncs instead of queueing one per write. Every write is one bolt
// transaction: on a full filesystem it fails whole (errdefs.ErrNoSpace,
// naming the filesystem) and the previous version stays. The exception is
// PutSandboxLazy (lazy.go): a background writer commits those records after
// the call returns, for state changes the runtime can tell again.
//
// Open quarantines records that no longer decode (quarantine.go), so one
// damaged record costs that record, not the daemon.
package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"sort"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/nospace"
	"github.com/cubesandbox/cube/internal/sandbox"
)

var (
	bucketSandboxes = []byte("sandboxes")
	bucketTemplates = []byte("templates")
	bucketJournal   = []byte("journal")
	bucketMeta      = []byte("meta")
)

// Store is the bbolt-backed state store. Safe for concurrent use.
type Store struct {
	db    *bolt.DB
	dir   string // holds the file: the filesystem a full-disk error names
	group committer
	lazy  *lazyWriter
}

// Option configures Open.
type Option func(*options)

type options struct{ log *slog.Logger }

// WithLogger logs what Open quarantines (default: slog.Default()).
func WithLogger(l *slog.Logger) Option { return func(o *options) { o.log = l } }

// Open opens (creating if needed) the store at path and quarantines the
// records that do not decode. A second cubelet on the same file fails fast
// instead of waiting forever for the lock.
func Open(path string, opts ...Option) (*Store, error) {
	o := options{log: slog.Default()}
	for _, opt := range opts {
		opt(&o)
	}
	dir := filepath.Dir(path)
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 2 * time.Second})
	if err != nil {
		return nil, fmt.Errorf("open state store %s: %w", path, nospace.Wrap(err, dir))
	}
	err = db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bucketSandboxes, bucketTemplates, bucketJournal, bucketMeta, bucketSnapshots, bucketQuarantine} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("init state store: %w", nospace.Wrap(err, dir))
	}
	s := &Store{db: db, dir: dir, lazy: newLazyWriter(o.log)}
	if err := s.quarantine(o.log); err != nil {
		db.Close()
		return nil, fmt.Errorf("state store %s: quarantine: %w", path, err)
	}
	ctx, stop := context.WithCancel(context.Background())
	s.lazy.stop = stop
	go s.lazy.run(ctx, s)
	return s, nil
}

// batch runs fn in a coalesced write transaction; a full filesystem comes
// back as ErrNoSpace naming it.
func (s *Store) batch(fn func(*bolt.Tx) error) error {
	return nospace.Wrap(s.write(fn), s.dir)
}

// Close commits the records PutSandboxLazy queued and closes the
// database file.
func (s *Store) Close() error {
	s.lazy.stop()
	<-s.lazy.done
	return s.db.Close()
}

func put(s *Store, bucket []byte, key string, v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return s.batch(func(tx *bolt.Tx) error {
		return tx.Bucket(bucket).Put([]byte(key), data)
	})
}

func get[T any](s *Store, bucket []byte, kind, key string) (*T, error) {
	var v T
	err := s.db.View(func(tx *bolt.Tx) error {
		data := tx.Bucket(bucket).Get([]byte(key))
		if data == nil {
			return fmt.Errorf("%s %q: %w", kind, key, errdefs.ErrNotFound)
		}
		return json.Unmarshal(data, &v)
	})
	if err != nil {
		return nil, err
	}
	return &v, nil
}

func list[T any](s *Store, bucket []byte) ([]*T, error) {
	var out []*T
	err := s.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucket).ForEach(func(_, data []byte) error {
			var v T
			if err := json.Unmarshal(data, &v); err != nil {
				return err
			}
			out = append(out, &v)
			return nil
		})
	})
	return out, err
}

func del(s *Store, bucket []byte, key string) error {
	return s.batch(func(tx *bolt.Tx) error {
		return tx.Bucket(bucket).Delete([]byte(key))
	})
}

// CreateSandbox inserts a new record; an existing ID is ErrAlreadyExists.
func (s *Store) CreateSandbox(r *sandbox.Record) error {
	data, err := json.Marshal(r) //nolint:gosec // G117: the node keeps the agent token to call the agent after a restart; the store file is root-only (0600)
	if err != nil {
		return err
	}
	return s.syncSandboxes(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketSandboxes)
		if b.Get([]byte(r.ID)) != nil {
			return fmt.Errorf("sandbox %q: %w", r.ID, errdefs.ErrAlreadyExists)
		}
		return b.Put([]byte(r.ID), data)
	}, r.ID)
}

// ReplaceSandbox inserts r and deletes the record old in one transaction
// (a warm pool's entry becoming the sandbox that claimed it): after a crash
// exactly one of them names the resources they share. An existing r.ID is
// ErrAlreadyExists, an absent old ErrNotFound; either leaves both as they were.
func (s *Store) ReplaceSandbox(old string, r *sandbox.Record) error {
	data, err := json.Marshal(r) //nolint:gosec // G117: as CreateSandbox
	if err != nil {
		return err
	}
	return s.syncSandboxes(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketSandboxes)
		if b.Get([]byte(r.ID)) != nil {
			return fmt.Errorf("sandbox %q: %w", r.ID, errdefs.ErrAlreadyExists)
		}
		if b.Get([]byte(old)) == nil {
			return fmt.Errorf("sandbox %q: %w", old, errdefs.ErrNotFound)
		}
		if err := b.Delete([]byte(old)); err != nil {
			return err
		}
		return b.Put([]byte(r.ID), data)
	}, old, r.ID)
}

// PutSandbox writes a record, replacing any previous version.
func (s *Store) PutSandbox(r *sandbox.Record) error {
	data, err := json.Marshal(r) //nolint:gosec // G117: as CreateSandbox
	if err != nil {
		return err
	}
	return s.syncSandboxes(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketSandboxes).Put([]byte(r.ID), data)
	}, r.ID)
}

// GetSandbox reads one record (a queued PutSandboxLazy one first); absent
// is ErrNotFound.
func (s *Store) GetSandbox(id string) (*sandbox.Record, error) {
	if data, ok := s.lazy.queued(id); ok {
		var r sandbox.Record
		if err := json.Unmarshal(data, &r); err != nil {
			return nil, err
		}
		return &r, nil
	}
	return get[sandbox.Record](s, bucketSandboxes, "sandbox", id)
}

// ListSandboxes returns every record (queued PutSandboxLazy ones instead
// of what they replace), ordered by creation time.
func (s *Store) ListSandboxes() ([]*sandbox.Record, error) {
	queued := s.lazy.queuedAll()
	out, err := list[sandbox.Record](s, bucketSandboxes)
	if err != nil {
		return nil, err
	}
	for i, r := range out {
		if data, ok := queued[r.ID]; ok {
			var q sandbox.Record
			if err := json.Unmarshal(data, &q); err != nil {
				return nil, err
			}
			out[i] = &q
			delete(queued, r.ID)
		}
	}
	for _, data := range queued {
		var q sandbox.Record
		if err := json.Unmarshal(data, &q); err != nil {
			return nil, err
		}
		out = append(out, &q)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.Before(out[j].CreatedAt) })
	return out, nil
}

// DeleteSandbox removes a record; absent is not an error.
func (s *Store) DeleteSandbox(id string) error {
	return s.syncSandboxes(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketSandboxes).Delete([]byte(id))
	}, id)
}

// CreateTemplate inserts a template; an existing ID is ErrAlreadyExists.
func (s *Store) CreateTemplate(t *sandbox.Template) error {
	data, err := json.Marshal(t)
	if err != nil {
		return err
	}
	return s.batch(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketTemplates)
		if b.Get([]byte(t.ID)) != nil {
			return fmt.Errorf("template %q: %w", t.ID, errdefs.ErrAlreadyExists)
		}
		return b.Put([]byte(t.ID), data)
	})
}

// PutTemplate replaces an existing template record.
func (s *Store) PutTemplate(t *sandbox.Template) error { return put(s, bucketTemplates, t.ID, t) }

// GetTemplate reads one template; absent is ErrNotFound.
func (s *Store) GetTemplate(id string) (*sandbox.Template, error) {
	return get[sandbox.Template](s, bucketTemplates, "template", id)
}

// ListTemplates returns every template ordered by ID.
func (s *Store) ListTemplates() ([]*sandbox.Template, error) {
	out, err := list[sandbox.Template](s, bucketTemplates)
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, err
}

// DeleteTemplate removes a template record.
func (s *Store) DeleteTemplate(id string) error { return del(s, bucketTemplates, id) }

// PutJournal records (or updates) a pending cleanup.
func (s *Store) PutJournal(e *sandbox.JournalEntry) error {
	return put(s, bucketJournal, e.SandboxID, e)
}

// ListJournal returns the pending cleanups.
func (s *Store) ListJournal() ([]*sandbox.JournalEntry, error) {
	return list[sandbox.JournalEntry](s, bucketJournal)
}

// DeleteJournal removes a finished cleanup.
func (s *Store) DeleteJournal(id string) error { return del(s, bucketJournal, id) }

// FinishDestroy deletes the sandbox record and its journal entry in one
// transaction, so a crash never leaves one without the other.
func (s *Store) FinishDestroy(id string) error {
	return s.syncSandboxes(func(tx *bolt.Tx) error {
		if err := tx.Bucket(bucketSandboxes).Delete([]byte(id)); err != nil {
			return err
		}
		return tx.Bucket(bucketJournal).Delete([]byte(id))
	}, id)
}

// Meta reads a small string value (node ID and the like); absent is "".
func (s *Store) Meta(key string) (string, error) {
	var v string
	err := s.db.View(func(tx *bolt.Tx) error {
		v = string(tx.Bucket(bucketMeta).Get([]byte(key)))
		return nil
	})
	return v, err
}

// SetMeta writes a small string value.
func (s *Store) SetMeta(key, value string) error {
	return nospace.Wrap(s.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketMeta).Put([]byte(key), []byte(value))
	}), s.dir)
}

// IsNotFound is a convenience for callers that only import store.
func IsNotFound(err error) bool { return errors.Is(err, errdefs.ErrNotFound) }
