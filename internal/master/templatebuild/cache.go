package templatebuild

import (
	"compress/gzip"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"hash"
	"io"
	"os"
	"path/filepath"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// A cached layer is kept compressed as the image will hold it
// (<key>.tar.gz), with its digests beside it (<key>.json, written last: a
// key is cached once its record exists), so that composing an image from
// cached layers reads no layer.

type layerRecord struct {
	Digest string `json:"digest"`
	DiffID string `json:"diff_id"`
	Size   int64  `json:"size"`
}

func (e *Engine) layerPath(key string) string  { return filepath.Join(e.o.Dir, "layers", key+".tar.gz") }
func (e *Engine) recordPath(key string) string { return filepath.Join(e.o.Dir, "layers", key+".json") }

func (e *Engine) cached(key string) bool {
	_, err := os.Stat(e.recordPath(key))
	return err == nil
}

// storeLayer writes a step's layer (write fills it uncompressed) under
// key; nothing is left of a failed store.
func (e *Engine) storeLayer(key string, write func(io.Writer) error) (layerRecord, error) {
	tmp, err := os.CreateTemp(filepath.Join(e.o.Dir, "layers"), ".tmp-")
	if err != nil {
		return layerRecord{}, err
	}
	defer os.Remove(tmp.Name())
	defer tmp.Close()
	ch, uh := sha256.New(), sha256.New()
	cw := &countWriter{w: io.MultiWriter(tmp, ch)}
	gz, err := gzip.NewWriterLevel(cw, gzip.BestSpeed)
	if err != nil {
		return layerRecord{}, err
	}
	if err := write(io.MultiWriter(gz, uh)); err != nil {
		return layerRecord{}, err
	}
	if err := gz.Close(); err != nil {
		return layerRecord{}, err
	}
	if err := tmp.Close(); err != nil {
		return layerRecord{}, err
	}
	rec := layerRecord{Digest: digestOf(ch), DiffID: digestOf(uh), Size: cw.n}
	if err := os.Rename(tmp.Name(), e.layerPath(key)); err != nil {
		return layerRecord{}, err
	}
	data, _ := json.Marshal(rec)
	rtmp := filepath.Join(e.o.Dir, "layers", ".tmp-rec-"+key)
	if err := os.WriteFile(rtmp, data, 0o600); err != nil {
		return layerRecord{}, err
	}
	if err := os.Rename(rtmp, e.recordPath(key)); err != nil {
		_ = os.Remove(rtmp)
		return layerRecord{}, err
	}
	return rec, nil
}

func digestOf(h hash.Hash) string { return fmt.Sprintf("sha256:%x", h.Sum(nil)) }

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// openLayer returns the cached layer of key as an image layer.
func (e *Engine) openLayer(key string) (v1.Layer, error) {
	data, err := os.ReadFile(e.recordPath(key))
	if err != nil {
		return nil, err
	}
	var rec layerRecord
	if err := json.Unmarshal(data, &rec); err != nil {
		return nil, fmt.Errorf("layer record %s: %w", key, err)
	}
	d, err := v1.NewHash(rec.Digest)
	if err != nil {
		return nil, err
	}
	diff, err := v1.NewHash(rec.DiffID)
	if err != nil {
		return nil, err
	}
	return &cachedLayer{path: e.layerPath(key), digest: d, diffID: diff, size: rec.Size}, nil
}

// uncompressedLayer opens a cached layer's tar stream.
func (e *Engine) uncompressedLayer(key string) (io.ReadCloser, error) {
	f, err := os.Open(e.layerPath(key))
	if err != nil {
		return nil, err
	}
	zr, err := gzip.NewReader(f)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("cached layer %s: %w", key, err)
	}
	return &gzReadCloser{Reader: zr, f: f}, nil
}

type gzReadCloser struct {
	*gzip.Reader
	f *os.File
}

func (g *gzReadCloser) Close() error {
	g.Reader.Close()
	return g.f.Close()
}

// cachedLayer is a v1.Layer over a cached .tar.gz with known digests.
type cachedLayer struct {
	path           string
	digest, diffID v1.Hash
	size           int64
}

var _ v1.Layer = (*cachedLayer)(nil)

func (l *cachedLayer) Digest() (v1.Hash, error)            { return l.digest, nil }
func (l *cachedLayer) DiffID() (v1.Hash, error)            { return l.diffID, nil }
func (l *cachedLayer) Size() (int64, error)                { return l.size, nil }
func (l *cachedLayer) MediaType() (types.MediaType, error) { return types.OCILayer, nil }
func (l *cachedLayer) Compressed() (io.ReadCloser, error)  { return os.Open(l.path) }
func (l *cachedLayer) Uncompressed() (io.ReadCloser, error) {
	f, err := os.Open(l.path)
	if err != nil {
		return nil, err
	}
	zr, err := gzip.NewReader(f)
	if err != nil {
		f.Close()
		return nil, err
	}
	return &gzReadCloser{Reader: zr, f: f}, nil
}
