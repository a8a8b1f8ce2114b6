// Package tmplstore is cubemaster's template store: the images of
// cluster-wide templates, kept as content-addressed blobs (manifest,
// config, layers) under the master's state directory, and one record per
// template naming its manifest digest. Nodes read blobs from it over their
// link to the master (NodeService.ReadBlob) and check each against its
// digest; the store checks them too when it writes them, so a source whose
// blobs do not match their digests never enters it.
//
// Layout under Dir:
//
//	blobs/sha256/<hex>     one blob, written to a temp file and renamed
//	templates/<id>.json    a Record, written the same way
//
// The directory is created on the first Put: a master that never imports
// through its store leaves no trace.
package tmplstore

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// Record is one template in the store.
type Record struct {
	ID string `json:"id"`
	// Digest is the image's manifest digest (sha256:<hex>), the image
	// digest nodes report for their copy.
	Digest string `json:"digest"`
	// Blobs is the size of the manifest, config and layers together: what
	// a node pulls.
	Blobs     int64     `json:"blob_bytes"`
	Source    string    `json:"source"`
	Runtime   string    `json:"runtime,omitempty"`
	Warm      bool      `json:"warm,omitempty"`
	CreatedAt time.Time `json:"created_at"`
}

// Store is a template store rooted at a directory.
type Store struct {
	dir string
	// mu orders imports with deletes: a Put holds it shared from its
	// first blob to its record, a Delete exclusively through the blob
	// sweep that follows it, so the sweep never removes the blobs of an
	// import whose record is not written yet.
	mu sync.RWMutex
}

// New returns the store at dir (created on the first Put).
func New(dir string) *Store { return &Store{dir: dir} }

// Dir is the store's directory.
func (s *Store) Dir() string { return s.dir }

var digestRE = regexp.MustCompile(`^sha256:[0-9a-f]{64}$`)

// ValidDigest reports whether d is a sha256 digest in canonical form.
func ValidDigest(d string) bool { return digestRE.MatchString(d) }

// BlobPath is where a blob with this digest lives (d must be valid).
func (s *Store) BlobPath(d string) string {
	return filepath.Join(s.dir, "blobs", "sha256", strings.TrimPrefix(d, "sha256:"))
}

func (s *Store) recordPath(id string) string { return filepath.Join(s.dir, "templates", id+".json") }

// Put stores img as template rec.ID (rec.Digest and rec.Blobs are filled
// in). The same ID with the same image again returns the existing record;
// with another image it is ErrAlreadyExists. Every blob is checked against
// its digest as it is written.
func (s *Store) Put(img v1.Image, rec Record) (Record, error) {
	d, err := img.Digest()
	if err != nil {
		return Record{}, fmt.Errorf("template store: image digest: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	rec.Digest = d.String()
	if old, err := s.Get(rec.ID); err == nil {
		if old.Digest != rec.Digest {
			return Record{}, fmt.Errorf("template %q is in the master's store with image %s; this source is %s: %w", rec.ID, old.Digest, rec.Digest, errdefs.ErrAlreadyExists)
		}
		return old, nil
	} else if !errdefs.IsNotFound(err) {
		return Record{}, err
	}
	raw, err := img.RawManifest()
	if err != nil {
		return Record{}, fmt.Errorf("template store: manifest: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	cfg, err := img.RawConfigFile()
	if err != nil {
		return Record{}, fmt.Errorf("template store: config: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	m, err := img.Manifest()
	if err != nil {
		return Record{}, fmt.Errorf("template store: manifest: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	layers, err := img.Layers()
	if err != nil {
		return Record{}, fmt.Errorf("template store: layers: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	if len(layers) != len(m.Layers) {
		return Record{}, fmt.Errorf("template store: %d layers, the manifest lists %d: %w", len(layers), len(m.Layers), errdefs.ErrInvalidArgument)
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	// Layers first and the manifest last: a manifest in the store means
	// everything it names is there.
	for i, l := range layers {
		if err := s.putLayer(l, m.Layers[i].Digest.String()); err != nil {
			return Record{}, err
		}
		rec.Blobs += m.Layers[i].Size
	}
	if err := s.putBytes(m.Config.Digest.String(), cfg); err != nil {
		return Record{}, err
	}
	if err := s.putBytes(rec.Digest, raw); err != nil {
		return Record{}, err
	}
	rec.Blobs += int64(len(cfg) + len(raw))
	if rec.CreatedAt.IsZero() {
		rec.CreatedAt = time.Now().UTC()
	}
	data, err := json.Marshal(rec)
	if err != nil {
		return Record{}, err
	}
	if err := writeAtomic(s.recordPath(rec.ID), data); err != nil {
		return Record{}, fmt.Errorf("template store: record %s: %w", rec.ID, err)
	}
	return rec, nil
}

func (s *Store) putLayer(l v1.Layer, want string) error {
	if st, err := os.Stat(s.BlobPath(want)); err == nil && st.Mode().IsRegular() {
		return nil // content-addressed: already there
	}
	rc, err := l.Compressed()
	if err != nil {
		return fmt.Errorf("template store: layer %s: %v: %w", want, err, errdefs.ErrInvalidArgument)
	}
	defer rc.Close()
	return s.putBlob(want, rc)
}

func (s *Store) putBytes(want string, b []byte) error {
	if st, err := os.Stat(s.BlobPath(want)); err == nil && st.Mode().IsRegular() {
		return nil
	}
	return s.putBlob(want, bytes.NewReader(b))
}

// putBlob writes r as the blob want, refusing it unless its bytes hash to
// want.
func (s *Store) putBlob(want string, r io.Reader) error {
	if !ValidDigest(want) {
		return fmt.Errorf("template store: digest %q: only sha256 is supported: %w", want, errdefs.ErrInvalidArgument)
	}
	dst := s.BlobPath(want)
	if err := os.MkdirAll(filepath.Dir(dst), 0o700); err != nil {
		return fmt.Errorf("template store: %w", err)
	}
	f, err := os.CreateTemp(filepath.Dir(dst), ".blob-*")
	if err != nil {
		return fmt.Errorf("template store: %w", err)
	}
	defer os.Remove(f.Name())
	h := sha256.New()
	_, cerr := io.Copy(io.MultiWriter(f, h), r)
	if err := errors.Join(cerr, f.Sync(), f.Close()); err != nil {
		return fmt.Errorf("template store: blob %s: %w", want, err)
	}
	if got := sum(h); got != want {
		return fmt.Errorf("template store: blob %s of the source hashes to %s: %w", want, got, errdefs.ErrInvalidArgument)
	}
	if err := os.Rename(f.Name(), dst); err != nil {
		return fmt.Errorf("template store: %w", err)
	}
	return nil
}

func sum(h hash.Hash) string { return "sha256:" + hex.EncodeToString(h.Sum(nil)) }

// Clean removes what a master that died mid-Put left: temp files of
// blobs and records, and import scratch directories (".import-*"). Blobs
// no record names stay until the next Delete sweeps them. Call it before
// any Put.
func (s *Store) Clean() error {
	var errs []error
	for _, pat := range []string{".import-*", filepath.Join("blobs", "sha256", ".blob-*"), filepath.Join("templates", ".rec-*")} {
		left, err := filepath.Glob(filepath.Join(s.dir, pat))
		if err != nil {
			return err
		}
		for _, p := range left {
			errs = append(errs, os.RemoveAll(p))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("template store: clean up: %w", err)
	}
	return nil
}

// Get returns one record; ErrNotFound when the store has no such template.
func (s *Store) Get(id string) (Record, error) {
	data, err := os.ReadFile(s.recordPath(id))
	if errors.Is(err, fs.ErrNotExist) {
		return Record{}, fmt.Errorf("template %q is not in the master's store: %w", id, errdefs.ErrNotFound)
	}
	if err != nil {
		return Record{}, fmt.Errorf("template store: %w", err)
	}
	var r Record
	if err := json.Unmarshal(data, &r); err != nil {
		return Record{}, fmt.Errorf("template store: record %s: %w", id, err)
	}
	return r, nil
}

// List returns every record, by ID.
func (s *Store) List() ([]Record, error) {
	ents, err := os.ReadDir(filepath.Join(s.dir, "templates"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("template store: %w", err)
	}
	var out []Record
	for _, e := range ents {
		id, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		r, err := s.Get(id)
		if err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, nil
}

// Delete removes a template's record, then every blob no remaining
// template uses. A missing record is not an error.
func (s *Store) Delete(id string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := os.Remove(s.recordPath(id)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("template store: %w", err)
	}
	return s.sweep()
}

// sweep removes blobs no record reaches. Caller holds mu.
func (s *Store) sweep() error {
	recs, err := s.List()
	if err != nil {
		return err
	}
	keep := map[string]bool{}
	for _, r := range recs {
		keep[r.Digest] = true
		raw, err := os.ReadFile(s.BlobPath(r.Digest))
		if err != nil {
			return fmt.Errorf("template store: manifest of %s: %w", r.ID, err)
		}
		m, err := v1.ParseManifest(bytes.NewReader(raw))
		if err != nil {
			return fmt.Errorf("template store: manifest of %s: %w", r.ID, err)
		}
		keep[m.Config.Digest.String()] = true
		for _, l := range m.Layers {
			keep[l.Digest.String()] = true
		}
	}
	dir := filepath.Join(s.dir, "blobs", "sha256")
	ents, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("template store: %w", err)
	}
	for _, e := range ents {
		if !keep["sha256:"+e.Name()] {
			if err := os.Remove(filepath.Join(dir, e.Name())); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return fmt.Errorf("template store: %w", err)
			}
		}
	}
	return nil
}

// ReadBlob reads up to len(p) bytes of blob d from off. It returns the
// count read and the blob's size; ErrNotFound for a blob not in the store.
func (s *Store) ReadBlob(d string, off int64, p []byte) (int, int64, error) {
	if !ValidDigest(d) {
		return 0, 0, fmt.Errorf("blob digest %q: want sha256:<64 hex>: %w", d, errdefs.ErrInvalidArgument)
	}
	if off < 0 {
		return 0, 0, fmt.Errorf("blob offset %d: %w", off, errdefs.ErrInvalidArgument)
	}
	f, err := os.Open(s.BlobPath(d))
	if errors.Is(err, fs.ErrNotExist) {
		return 0, 0, fmt.Errorf("blob %s is not in the master's template store: %w", d, errdefs.ErrNotFound)
	}
	if err != nil {
		return 0, 0, fmt.Errorf("template store: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return 0, 0, fmt.Errorf("template store: %w", err)
	}
	n, err := f.ReadAt(p, off)
	if err != nil && !errors.Is(err, io.EOF) {
		return 0, 0, fmt.Errorf("template store: %w", err)
	}
	return n, st.Size(), nil
}

func writeAtomic(path string, data []byte) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(path), ".rec-*")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	_, werr := f.Write(data)
	if err := errors.Join(werr, f.Sync(), f.Close()); err != nil {
		return err
	}
	return os.Rename(f.Name(), path)
}

// Layout writes template id's image as an OCI image layout into dir
// (which must exist and be empty): its blobs are hard links to the
// store's (copies where a link fails), so the layout costs no space.
func (s *Store) Layout(id, dir string) error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	r, err := s.Get(id)
	if err != nil {
		return err
	}
	raw, err := os.ReadFile(s.BlobPath(r.Digest))
	if err != nil {
		return fmt.Errorf("template store: manifest of %s: %w", id, err)
	}
	m, err := v1.ParseManifest(bytes.NewReader(raw))
	if err != nil {
		return fmt.Errorf("template store: manifest of %s: %w", id, err)
	}
	mt := m.MediaType
	if mt == "" {
		mt = types.OCIManifestSchema1
	}
	digests := []string{r.Digest, m.Config.Digest.String()}
	for _, l := range m.Layers {
		digests = append(digests, l.Digest.String())
	}
	blobs := filepath.Join(dir, "blobs", "sha256")
	if err := os.MkdirAll(blobs, 0o700); err != nil {
		return fmt.Errorf("template store: %w", err)
	}
	for _, d := range digests {
		dst := filepath.Join(blobs, strings.TrimPrefix(d, "sha256:"))
		if _, err := os.Lstat(dst); err == nil {
			continue // a layer the image lists twice
		}
		if err := os.Link(s.BlobPath(d), dst); err != nil {
			if err := copyFile(s.BlobPath(d), dst); err != nil {
				return fmt.Errorf("template store: blob %s of %s: %w", d, id, err)
			}
		}
	}
	hash, err := v1.NewHash(r.Digest)
	if err != nil {
		return fmt.Errorf("template store: %w", err)
	}
	index, err := json.Marshal(map[string]any{
		"schemaVersion": 2,
		"manifests":     []v1.Descriptor{{MediaType: mt, Digest: hash, Size: int64(len(raw))}},
	})
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "index.json"), index, 0o600); err != nil {
		return fmt.Errorf("template store: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "oci-layout"), []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o600); err != nil {
		return fmt.Errorf("template store: %w", err)
	}
	return nil
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	_, cerr := io.Copy(out, in)
	return errors.Join(cerr, out.Close())
}
