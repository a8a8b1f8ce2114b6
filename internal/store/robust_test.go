package store

import (
	"bytes"
	"errors"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/nospace/nospacetest"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// syncBuffer is a log sink safe for the store's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (w *syncBuffer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (w *syncBuffer) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// writeRaw puts bytes under a key with bolt itself, as damage would.
func writeRaw(t *testing.T, path, bucket, key string, val []byte) {
	t.Helper()
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if err := db.Update(func(tx *bolt.Tx) error { return tx.Bucket([]byte(bucket)).Put([]byte(key), val) }); err != nil {
		t.Fatal(err)
	}
}

// TestQuarantineUndecodable: one sandbox record turned to garbage (and a
// snapshot record of the wrong shape) are moved to the quarantine bucket
// with an error log naming the key, and the store opens and serves the
// rest. The control: the same store before the damage opens with nothing
// quarantined and serves the record that is later damaged.
func TestQuarantineUndecodable(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.db")
	s, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC()
	for _, id := range []string{"good", "bad"} {
		if err := s.CreateSandbox(&sandbox.Record{ID: id, State: lifecycle.Running, CreatedAt: now}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.CreateTemplate(&sandbox.Template{ID: "tpl"}); err != nil {
		t.Fatal(err)
	}
	if err := s.CreateSnapshot(&sandbox.Snapshot{ID: "snap-bad", CreatedAt: now}); err != nil {
		t.Fatal(err)
	}
	s.Close()

	// Control: undamaged, nothing is quarantined and both are served.
	var logs syncBuffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	s, err = Open(path, WithLogger(log))
	if err != nil {
		t.Fatal(err)
	}
	if q, _ := s.ListQuarantined(); len(q) != 0 {
		t.Fatalf("control: quarantined %v", q)
	}
	if r, err := s.GetSandbox("bad"); err != nil || r.State != lifecycle.Running {
		t.Fatalf("control: record before damage: %v %v", r, err)
	}
	s.Close()

	garbage := []byte("{\"id\":\"bad\",\"state\":\x00\xff not json")
	writeRaw(t, path, "sandboxes", "bad", garbage)
	writeRaw(t, path, "snapshots", "snap-bad", []byte(`{"id":"snap-bad","created_at":42}`))

	s, err = Open(path, WithLogger(log))
	if err != nil {
		t.Fatalf("open with a damaged record: %v", err)
	}
	defer s.Close()
	t.Logf("log:\n%s", logs.String())
	for _, key := range []string{"sandboxes/bad", "snapshots/snap-bad"} {
		if !strings.Contains(logs.String(), "level=ERROR") || !strings.Contains(logs.String(), "quarantine_key="+key) {
			t.Errorf("no error log naming %s", key)
		}
	}
	list, err := s.ListSandboxes()
	if err != nil || len(list) != 1 || list[0].ID != "good" {
		t.Fatalf("sandboxes after quarantine: %v %v", list, err)
	}
	if _, err := s.GetSandbox("bad"); !errdefs.IsNotFound(err) {
		t.Fatalf("damaged record still served: %v", err)
	}
	if tpl, err := s.GetTemplate("tpl"); err != nil || tpl.ID != "tpl" {
		t.Fatalf("template: %v %v", tpl, err)
	}
	if sn, err := s.ListSnapshots(); err != nil || len(sn) != 0 {
		t.Fatalf("snapshots: %v %v", sn, err)
	}
	q, err := s.ListQuarantined()
	if err != nil || len(q) != 2 {
		t.Fatalf("quarantined: %v %v", q, err)
	}
	if q[0].Bucket != "sandboxes" || q[0].Key != "bad" || !bytes.Equal(q[0].Value, garbage) || q[0].Error == "" {
		t.Fatalf("quarantined sandbox: %+v", q[0])
	}
	// The slot is free again: the ID can be written anew.
	if err := s.CreateSandbox(&sandbox.Record{ID: "bad", State: lifecycle.Creating, CreatedAt: now}); err != nil {
		t.Fatal(err)
	}
	s.Close()

	// Opening again quarantines nothing more and logs nothing.
	var again syncBuffer
	s, err = Open(path, WithLogger(slog.New(slog.NewTextHandler(&again, nil))))
	if err != nil {
		t.Fatal(err)
	}
	if q, _ := s.ListQuarantined(); len(q) != 2 || again.String() != "" {
		t.Fatalf("second open: %d quarantined, log %q", len(q), again.String())
	}
}

// TestNoSpace: on a full filesystem a write fails whole with ErrNoSpace
// naming the filesystem, the previous version stays readable, the file
// passes bolt's consistency check, and the same write succeeds once space
// returns, without reopening the store.
func TestNoSpace(t *testing.T) {
	for _, fstype := range []string{"ext4", "tmpfs"} {
		t.Run(fstype, func(t *testing.T) {
			mnt := nospacetest.Mount(t, fstype, 16)
			s, err := Open(filepath.Join(mnt, "state.db"))
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			now := time.Now().UTC()
			v1 := &sandbox.Record{ID: "sb1", State: lifecycle.Running, CreatedAt: now, Labels: map[string]string{"v": "1"}}
			if err := s.CreateSandbox(v1); err != nil {
				t.Fatal(err)
			}
			free := nospacetest.Fill(t, mnt)

			// Values large enough that the write needs new pages: the file
			// must grow, and the filesystem has no block for it.
			big := strings.Repeat("x", 4<<20)
			v2 := &sandbox.Record{ID: "sb1", State: lifecycle.Paused, CreatedAt: now, Labels: map[string]string{"v": "2", "pad": big}}
			err = s.PutSandbox(v2)
			t.Logf("put on full %s: %v", fstype, err)
			if !errdefs.IsNoSpace(err) || !strings.Contains(err.Error(), mnt) {
				t.Fatalf("put on full disk: %v, want ErrNoSpace naming %s", err, mnt)
			}
			newRec := &sandbox.Record{ID: "sb2", State: lifecycle.Creating, CreatedAt: now, Labels: map[string]string{"pad": big}}
			if err := s.CreateSandbox(newRec); !errdefs.IsNoSpace(err) {
				t.Fatalf("create on full disk: %v", err)
			}
			if r, err := s.GetSandbox("sb1"); err != nil || r.State != lifecycle.Running || r.Labels["v"] != "1" {
				t.Fatalf("after failed put: %+v %v, want version 1", r, err)
			}
			if _, err := s.GetSandbox("sb2"); !errdefs.IsNotFound(err) {
				t.Fatalf("failed create left a record: %v", err)
			}
			if err := check(s); err != nil {
				t.Fatalf("consistency after ENOSPC: %v", err)
			}

			free()
			if err := s.PutSandbox(v2); err != nil {
				t.Fatalf("put after freeing space: %v", err)
			}
			if err := s.CreateSandbox(newRec); err != nil {
				t.Fatalf("create after freeing space: %v", err)
			}
			if r, err := s.GetSandbox("sb1"); err != nil || r.State != lifecycle.Paused || r.Labels["v"] != "2" {
				t.Fatalf("after recovery: %v %v", r, err)
			}
			if err := check(s); err != nil {
				t.Fatalf("consistency after recovery: %v", err)
			}
		})
	}
}

func check(s *Store) error {
	return s.db.View(func(tx *bolt.Tx) error {
		var errs []error
		for err := range tx.Check() {
			errs = append(errs, err)
		}
		return errors.Join(errs...)
	})
}
