package template

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"hash"
	"io"
	"sync"

	"github.com/klauspost/compress/zstd"

	v1 "github.com/google/go-containerregistry/pkg/v1"
)

// A layer is verified while it streams: every byte read from its blob goes
// through sha256 before it is decompressed, and the sum is compared with
// the digest the manifest names. What the flattener never reads (the
// padding after a tar's end marker) is drained afterwards by verifyAll, so
// a blob is accepted only when all of it matched, whatever the source's own
// checks do (a registry blob is verified by go-containerregistry too, an
// OCI layout blob by nobody else).
//
// Docker archives are the exception: go-containerregistry gzips their
// plain-tar layers on the fly to produce a "compressed" digest, so there
// the uncompressed stream is checked against the config's diff ID instead.

// reporter serialises progress: layers are opened and read on the
// flattener's goroutine while phases are reported from Import's.
type reporter struct {
	mu      sync.Mutex
	fn      func(Progress)
	cur     Progress
	lastAt  int64 // Bytes at the last report
	stopped bool
}

// stop drops every later report: after a failed Build the flattener's
// goroutine can still be finishing a read, and the callback (a gRPC stream)
// must not be used once Build has returned.
func (r *reporter) stop() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.stopped = true
}

// emit reports r.cur; r.mu is held.
func (r *reporter) emit() {
	if !r.stopped {
		r.fn(r.cur)
	}
}

const reportEvery = 1 << 20

func (r *reporter) phase(p string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cur.Phase = p
	r.emit()
}

func (r *reporter) layerOpened() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cur.Layer++
	r.lastAt = r.cur.Bytes
	r.emit()
}

func (r *reporter) add(n int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cur.Bytes += int64(n)
	if r.cur.Bytes-r.lastAt >= reportEvery {
		r.lastAt = r.cur.Bytes
		r.emit()
	}
}

// verifier tracks every layer stream opened during one import.
type verifier struct {
	byDiffID bool
	rep      *reporter
	mu       sync.Mutex
	streams  []*layerStream
	closed   bool // set by closeAll: a late-opened stream closes itself
}

func (v *verifier) wrap(img v1.Image) v1.Image { return &verifiedImage{Image: img, v: v} }

// verifyAll finishes every stream: drains what the flattener left unread
// and checks the digests. Call it after a successful extraction.
func (v *verifier) verifyAll() error {
	v.mu.Lock()
	defer v.mu.Unlock()
	var errs []error
	for _, s := range v.streams {
		errs = append(errs, s.finish())
	}
	return errors.Join(errs...)
}

// closeAll releases every stream without draining (a failed import).
func (v *verifier) closeAll() {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.closed = true
	for _, s := range v.streams {
		_ = s.src.Close()
	}
}

type verifiedImage struct {
	v1.Image
	v *verifier
}

func (i *verifiedImage) Layers() ([]v1.Layer, error) {
	ls, err := i.Image.Layers()
	if err != nil {
		return nil, err
	}
	out := make([]v1.Layer, len(ls))
	for n, l := range ls {
		out[n] = &verifiedLayer{Layer: l, v: i.v}
	}
	return out, nil
}

type verifiedLayer struct {
	v1.Layer
	v *verifier
}

// Uncompressed returns the layer's tar stream, hashed on the way.
func (l *verifiedLayer) Uncompressed() (io.ReadCloser, error) {
	l.v.rep.layerOpened()
	var (
		want v1.Hash
		size int64 = -1
		src  io.ReadCloser
		err  error
	)
	if l.v.byDiffID {
		if want, err = l.DiffID(); err == nil {
			src, err = l.Layer.Uncompressed()
		}
	} else {
		if want, err = l.Digest(); err == nil {
			if size, err = l.Size(); err == nil {
				src, err = l.Compressed()
			}
		}
	}
	if err != nil {
		return nil, registryErr("layer "+want.String(), err)
	}
	if want.Algorithm != "sha256" {
		_ = src.Close()
		return nil, invalid("layer %s: unsupported digest algorithm", want)
	}
	s := &layerStream{src: src, h: sha256.New(), want: want, size: size, rep: l.v.rep}
	l.v.mu.Lock()
	closed := l.v.closed
	if !closed {
		l.v.streams = append(l.v.streams, s)
	}
	l.v.mu.Unlock()
	if closed {
		// The import already failed; the flattener has not noticed yet.
		_ = src.Close()
		return nil, errors.New("template: import abandoned")
	}
	if l.v.byDiffID {
		return &tarStream{r: s, s: s}, nil
	}
	br := bufio.NewReader(s)
	magic, _ := br.Peek(4)
	var r io.Reader = br
	var closeDec func()
	switch {
	case bytes.HasPrefix(magic, []byte{0x1f, 0x8b}):
		zr, err := gzip.NewReader(br)
		if err != nil {
			return nil, s.failed(err)
		}
		r, closeDec = zr, func() { _ = zr.Close() }
	case bytes.HasPrefix(magic, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		zr, err := zstd.NewReader(br)
		if err != nil {
			return nil, s.failed(err)
		}
		r, closeDec = zr, zr.Close
	}
	return &tarStream{r: r, s: s, closeDec: closeDec}, nil
}

// layerStream hashes and counts a layer blob as it is read.
type layerStream struct {
	src  io.ReadCloser
	h    hash.Hash
	want v1.Hash
	size int64 // declared blob size; -1 when checking a diff ID
	n    int64
	rerr error // first read error other than EOF
	eof  bool
	rep  *reporter
	done bool
	err  error // verdict, once done
}

func (s *layerStream) Read(p []byte) (int, error) {
	n, err := s.src.Read(p)
	s.n += int64(n)
	s.h.Write(p[:n])
	s.rep.add(n)
	switch {
	case err == io.EOF:
		s.eof = true
	case err != nil && s.rerr == nil:
		s.rerr = err
	}
	return n, err
}

// finish drains the blob (never past its declared size, plus one byte to
// notice a longer one) and compares the digest. It runs once.
func (s *layerStream) finish() error {
	if s.done {
		return s.err
	}
	s.done = true
	if !s.eof && s.rerr == nil {
		var lim io.Reader = s
		if s.size >= 0 {
			lim = io.LimitReader(s, max(s.size-s.n, 0)+1)
		}
		_, _ = io.Copy(io.Discard, lim)
	}
	_ = s.src.Close()
	got := "sha256:" + hex.EncodeToString(s.h.Sum(nil))
	complete := s.eof || (s.size >= 0 && s.n >= s.size)
	switch {
	case complete && got != s.want.String():
		s.err = invalid("layer %s: content does not match its digest (read %d bytes hashing to %s): tampered or corrupt blob", s.want, s.n, got)
	case s.size >= 0 && s.n != s.size && complete:
		s.err = invalid("layer %s: blob is %d bytes, manifest says %d", s.want, s.n, s.size)
	case s.rerr != nil:
		s.err = registryErr("layer "+s.want.String(), s.rerr)
	case !complete:
		s.err = invalid("layer %s: blob ended after %d bytes", s.want, s.n)
	}
	return s.err
}

// failed turns a decompression error into the digest verdict when the blob
// turns out not to match (the likelier story), else the error itself.
func (s *layerStream) failed(err error) error {
	if verr := s.finish(); verr != nil {
		return verr
	}
	return invalid("layer %s: %v", s.want, err)
}

// tarStream is what the flattener reads: the decompressed layer. At its
// end or on a decompression error the blob's verdict is taken, so a
// mismatch surfaces as such rather than as "gzip: invalid checksum".
type tarStream struct {
	r        io.Reader
	s        *layerStream
	closeDec func()
}

func (t *tarStream) Read(p []byte) (int, error) {
	n, err := t.r.Read(p)
	switch {
	case err == io.EOF:
		if verr := t.s.finish(); verr != nil {
			return n, verr
		}
	case err != nil:
		return n, t.s.failed(err)
	}
	return n, err
}

// Close leaves the blob open: verifyAll drains it after a successful
// extraction, closeAll closes it after a failed one.
func (t *tarStream) Close() error {
	if t.closeDec != nil {
		t.closeDec()
	}
	return nil
}
