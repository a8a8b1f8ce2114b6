package store

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"sort"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cubesandbox/cube/internal/nospace"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// bucketQuarantine holds records Open found undecodable, keyed
// "<bucket>/<key>", each a JSON Quarantined. Nothing reads them back into
// service: they are kept for an operator to inspect (docs/operating-cubelet.md).
var bucketQuarantine = []byte("quarantine")

// Quarantined is one record moved out of service.
type Quarantined struct {
	Bucket string    `json:"bucket"` // where it was: sandboxes, templates, journal, snapshots
	Key    string    `json:"key"`    // its key there (the sandbox, template or snapshot ID)
	Error  string    `json:"error"`  // why it did not decode
	At     time.Time `json:"at"`     // when Open moved it
	Value  []byte    `json:"value"`  // the bytes as they were
}

// decoders are the typed buckets and how a value in each decodes.
var decoders = []struct {
	bucket []byte
	decode func([]byte) error
}{
	{bucketSandboxes, decodeAs[sandbox.Record]},
	{bucketTemplates, decodeAs[sandbox.Template]},
	{bucketJournal, decodeAs[sandbox.JournalEntry]},
	{bucketSnapshots, decodeAs[sandbox.Snapshot]},
}

func decodeAs[T any](data []byte) error {
	var v T
	return json.Unmarshal(data, &v)
}

// quarantine moves every record that does not decode into its type to the
// quarantine bucket, in one transaction, and logs each at error level with
// its key. The read-only scan comes first so a clean store (the usual
// case) costs no write.
func (s *Store) quarantine(log *slog.Logger) error {
	type bad struct {
		bucket, key string
		err         error
	}
	var found []bad
	err := s.db.View(func(tx *bolt.Tx) error {
		for _, d := range decoders {
			err := tx.Bucket(d.bucket).ForEach(func(k, v []byte) error {
				if err := d.decode(v); err != nil {
					found = append(found, bad{string(d.bucket), string(k), err})
				}
				return nil
			})
			if err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil || len(found) == 0 {
		return err
	}
	now := time.Now().UTC()
	err = s.db.Update(func(tx *bolt.Tx) error {
		q := tx.Bucket(bucketQuarantine)
		for _, f := range found {
			b := tx.Bucket([]byte(f.bucket))
			val := b.Get([]byte(f.key))
			data, err := json.Marshal(Quarantined{Bucket: f.bucket, Key: f.key, Error: f.err.Error(), At: now,
				Value: append([]byte(nil), val...)})
			if err != nil {
				return err
			}
			if err := q.Put([]byte(f.bucket+"/"+f.key), data); err != nil {
				return err
			}
			if err := b.Delete([]byte(f.key)); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("move %d undecodable records: %w", len(found), nospace.Wrap(err, s.dir))
	}
	for _, f := range found {
		log.Error("state store: undecodable record quarantined", "bucket", f.bucket, "key", f.key,
			"quarantine_key", f.bucket+"/"+f.key, "err", f.err)
	}
	return nil
}

// ListQuarantined returns the quarantined records, by key.
func (s *Store) ListQuarantined() ([]*Quarantined, error) {
	var out []*Quarantined
	err := s.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketQuarantine).ForEach(func(_, data []byte) error {
			var q Quarantined
			if err := json.Unmarshal(data, &q); err != nil {
				return err
			}
			out = append(out, &q)
			return nil
		})
	})
	sort.Slice(out, func(i, j int) bool { return out[i].Bucket+"/"+out[i].Key < out[j].Bucket+"/"+out[j].Key })
	return out, err
}
