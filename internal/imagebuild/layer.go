// Package imagebuild builds OCI images without a container engine: layers
// are tar streams written here (Go binaries and generated files) or
// rewritten from Debian packages (apt-get download, dpkg-deb), images are
// assembled with go-containerregistry and written as OCI layouts or pushed
// to a registry.
//
// Every image is reproducible: entries are sorted, owned by root, stamped
// with one fixed time (Epoch), and the image config carries the same time,
// so the same inputs give the same digests on any machine.
package imagebuild

import (
	"archive/tar"
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"sort"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// Epoch is the time every entry and image config carries (the
// SOURCE_DATE_EPOCH convention's 0 would show as 1970 in tools; a fixed
// date reads better and is just as stable).
var Epoch = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// Entry is one file, directory or symlink of a layer.
type Entry struct {
	Path string // in the image, without a leading slash: usr/bin/cubelet
	Mode int64  // permission bits; 0 = 0755 for dirs and Src files, 0644 for Data
	// One of: Src (a file on this machine, copied), Data (the content),
	// Link (a symlink target), Dir.
	Src  string
	Data []byte
	Link string
	Dir  bool
}

// FilesLayer writes entries (and their missing parent directories) as one
// layer. The tar goes to a file under tmpDir: layers are kept as files, the
// node image's Debian packages are hundreds of MiB.
func FilesLayer(tmpDir string, entries []Entry) (v1.Layer, error) {
	w, err := newLayerWriter(tmpDir)
	if err != nil {
		return nil, err
	}
	sorted := append([]Entry(nil), entries...)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].Path < sorted[j].Path })
	for _, e := range sorted {
		if err := w.add(e); err != nil {
			w.abort()
			return nil, fmt.Errorf("layer entry %s: %w", e.Path, err)
		}
	}
	return w.finish()
}

// layerWriter writes a deterministic tar: parents before children, each
// path once, fixed owner and time.
type layerWriter struct {
	f    *os.File
	bw   *bufio.Writer
	tw   *tar.Writer
	seen map[string]bool
}

func newLayerWriter(tmpDir string) (*layerWriter, error) {
	f, err := os.CreateTemp(tmpDir, "layer-*.tar")
	if err != nil {
		return nil, err
	}
	bw := bufio.NewWriterSize(f, 1<<20)
	return &layerWriter{f: f, bw: bw, tw: tar.NewWriter(bw), seen: map[string]bool{}}, nil
}

func (w *layerWriter) abort() {
	w.f.Close()
	os.Remove(w.f.Name())
}

func (w *layerWriter) finish() (v1.Layer, error) {
	if err := w.tw.Close(); err != nil {
		w.abort()
		return nil, err
	}
	if err := w.bw.Flush(); err != nil {
		w.abort()
		return nil, err
	}
	if err := w.f.Close(); err != nil {
		return nil, err
	}
	// Compressed on demand with gzip at a fixed level: the same tar gives
	// the same blob.
	return tarball.LayerFromFile(w.f.Name())
}

func cleanPath(p string) (string, error) {
	c := path.Clean(strings.TrimPrefix(strings.TrimPrefix(p, "./"), "/"))
	if c == "." || c == "" || strings.HasPrefix(c, "../") || c == ".." {
		return "", fmt.Errorf("path %q outside the image: %w", p, errdefs.ErrInvalidArgument)
	}
	return c, nil
}

// parents writes the directories above p that the layer lacks.
func (w *layerWriter) parents(p string) error {
	dir := path.Dir(p)
	if dir == "." || w.seen[dir+"/"] {
		return nil
	}
	if err := w.parents(dir); err != nil {
		return err
	}
	return w.header(&tar.Header{Typeflag: tar.TypeDir, Name: dir + "/", Mode: 0o755}, nil)
}

// header writes hdr with the fixed owner and time; body is its content.
func (w *layerWriter) header(hdr *tar.Header, body io.Reader) error {
	key := hdr.Name
	if w.seen[key] || (hdr.Typeflag != tar.TypeDir && w.seen[key+"/"]) {
		// A later package shipping a path an earlier one shipped
		// (directories mostly): the first wins.
		if body != nil {
			_, err := io.Copy(io.Discard, body)
			return err
		}
		return nil
	}
	w.seen[key] = true
	hdr.Uid, hdr.Gid, hdr.Uname, hdr.Gname = 0, 0, "", ""
	hdr.ModTime, hdr.AccessTime, hdr.ChangeTime = Epoch, time.Time{}, time.Time{}
	hdr.Format = tar.FormatPAX
	hdr.PAXRecords = nil
	if err := w.tw.WriteHeader(hdr); err != nil {
		return err
	}
	if body != nil {
		if _, err := io.Copy(w.tw, body); err != nil {
			return err
		}
	}
	return nil
}

func (w *layerWriter) add(e Entry) error {
	p, err := cleanPath(e.Path)
	if err != nil {
		return err
	}
	if err := w.parents(p); err != nil {
		return err
	}
	switch {
	case e.Dir:
		return w.header(&tar.Header{Typeflag: tar.TypeDir, Name: p + "/", Mode: orMode(e.Mode, 0o755)}, nil)
	case e.Link != "":
		return w.header(&tar.Header{Typeflag: tar.TypeSymlink, Name: p, Linkname: e.Link, Mode: 0o777}, nil)
	case e.Src != "":
		f, err := os.Open(e.Src)
		if err != nil {
			return fmt.Errorf("%w: %w", err, errdefs.ErrNotFound)
		}
		defer f.Close()
		fi, err := f.Stat()
		if err != nil {
			return err
		}
		if !fi.Mode().IsRegular() {
			return fmt.Errorf("%s is not a regular file: %w", e.Src, errdefs.ErrInvalidArgument)
		}
		return w.header(&tar.Header{Typeflag: tar.TypeReg, Name: p, Size: fi.Size(), Mode: orMode(e.Mode, 0o755)}, f)
	default:
		return w.header(&tar.Header{Typeflag: tar.TypeReg, Name: p, Size: int64(len(e.Data)), Mode: orMode(e.Mode, 0o644)}, bytes.NewReader(e.Data))
	}
}

func orMode(m, def int64) int64 {
	if m == 0 {
		return def
	}
	return m
}

// copyTar copies the entries of an existing tar stream (a Debian package's
// data) into the layer with the fixed owner and time. Paths under skip
// (prefixes, no leading slash) are left out.
func (w *layerWriter) copyTar(r io.Reader, skip []string) error {
	tr := tar.NewReader(r)
next:
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		name := strings.TrimPrefix(strings.TrimPrefix(hdr.Name, "./"), "/")
		if name == "" {
			continue
		}
		for _, s := range skip {
			if strings.HasPrefix(name, s) {
				continue next
			}
		}
		clean, err := cleanPath(name)
		if err != nil {
			return err
		}
		if err := w.parents(clean); err != nil {
			return err
		}
		out := &tar.Header{Typeflag: hdr.Typeflag, Name: clean, Mode: hdr.Mode & 0o7777, Size: hdr.Size, Linkname: hdr.Linkname}
		switch hdr.Typeflag {
		case tar.TypeDir:
			out.Name += "/"
		case tar.TypeLink:
			// Hard links name their target as a path in the same tar.
			if out.Linkname, err = cleanPath(hdr.Linkname); err != nil {
				return err
			}
		case tar.TypeReg, tar.TypeSymlink:
		default:
			continue // devices and fifos have no place in an image built here
		}
		var body io.Reader
		if out.Typeflag == tar.TypeReg {
			body = tr
		}
		if err := w.header(out, body); err != nil {
			return err
		}
	}
}
