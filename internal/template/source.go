package template

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/cubesandbox/cube/internal/errdefs"
)

func invalid(format string, args ...any) error {
	return fmt.Errorf("template: "+format+": %w", append(args, errdefs.ErrInvalidArgument)...)
}

// openSource resolves a local source to one image. scratch is a private
// directory the caller removes; an OCI archive is unpacked there. byDiffID
// says the layers are to be verified uncompressed (docker archives, see
// verify.go).
func openSource(src, scratch string) (img v1.Image, byDiffID bool, err error) {
	img, err = openLocal(src, scratch)
	if err != nil {
		return nil, false, err
	}
	_, isDocker := img.(dockerArchive)
	return img, isDocker, nil
}

// dockerArchive marks images read from `docker save` tarballs.
type dockerArchive struct{ v1.Image }

func openLocal(src, scratch string) (v1.Image, error) {
	st, err := os.Stat(src)
	if err != nil {
		return nil, invalid("source %s: %v", src, err)
	}
	if st.IsDir() {
		if _, err := os.Stat(filepath.Join(src, "oci-layout")); err != nil {
			return nil, invalid("source directory %s is not an OCI image layout (no oci-layout file)", src)
		}
		return imageFromLayout(src)
	}
	if !st.Mode().IsRegular() {
		return nil, invalid("source %s is neither a directory nor a regular file", src)
	}
	names, err := tarNames(src)
	if err != nil {
		return nil, invalid("source %s is not a tar archive: %v", src, err)
	}
	switch {
	case names["manifest.json"]:
		// docker-archive (`docker save`); newer docker also adds an OCI
		// layout, but manifest.json reads without unpacking.
		img, err := tarball.ImageFromPath(src, nil)
		if err != nil {
			return nil, invalid("docker archive %s: %v", src, err)
		}
		return dockerArchive{img}, nil
	case names["oci-layout"]:
		dir := filepath.Join(scratch, "oci")
		if err := untarPlain(src, dir); err != nil {
			return nil, err
		}
		return imageFromLayout(dir)
	default:
		return nil, invalid("tar %s holds neither manifest.json (docker archive) nor oci-layout (OCI archive)", src)
	}
}

func tarNames(file string) (map[string]bool, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	names := map[string]bool{}
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			if len(names) == 0 {
				return nil, errors.New("empty archive")
			}
			return names, nil
		}
		if err != nil {
			return nil, err
		}
		names[path.Clean(strings.TrimPrefix(h.Name, "/"))] = true
	}
}

// untarPlain unpacks an OCI archive. A layout holds only directories and
// regular files, so anything else, and any path leaving dir, is refused;
// with no symlinks created, joining cleaned names cannot escape.
func untarPlain(file, dir string) error {
	f, err := os.Open(file)
	if err != nil {
		return fmt.Errorf("template: %w", err)
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return invalid("OCI archive %s: %v", file, err)
		}
		name := path.Clean("/" + h.Name)[1:]
		if name == "" {
			continue
		}
		dst := filepath.Join(dir, filepath.FromSlash(name))
		switch h.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(dst, 0o755); err != nil {
				return fmt.Errorf("template: unpack OCI archive: %w", err)
			}
		case tar.TypeReg:
			if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
				return fmt.Errorf("template: unpack OCI archive: %w", err)
			}
			out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
			if err != nil {
				return invalid("OCI archive %s: entry %q: %v", file, h.Name, err)
			}
			_, cerr := io.Copy(out, tr) //nolint:gosec // G110: the operator's own image, unpacked in full by design
			if err := errors.Join(cerr, out.Close()); err != nil {
				return fmt.Errorf("template: unpack OCI archive %s: %w", h.Name, err)
			}
		default:
			return invalid("OCI archive %s: unexpected entry %q of type %q", file, h.Name, h.Typeflag)
		}
	}
}

// imageFromLayout picks the image for this host from a layout: the first
// image manifest whose platform matches linux/GOARCH (descending into
// nested indexes), else the first image manifest.
func imageFromLayout(dir string) (v1.Image, error) {
	idx, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		return nil, invalid("OCI layout %s: %v", dir, err)
	}
	img, err := pickImage(idx, 0)
	if err != nil {
		return nil, invalid("OCI layout %s: %v", dir, err)
	}
	return img, nil
}

func pickImage(idx v1.ImageIndex, depth int) (v1.Image, error) {
	if depth > 4 {
		return nil, errors.New("indexes nested too deep")
	}
	im, err := idx.IndexManifest()
	if err != nil {
		return nil, err
	}
	var fallback *v1.Descriptor
	for i := range im.Manifests {
		d := &im.Manifests[i]
		switch {
		case d.MediaType.IsIndex():
			child, err := idx.ImageIndex(d.Digest)
			if err != nil {
				return nil, err
			}
			if img, err := pickImage(child, depth+1); err == nil {
				return img, nil
			}
		case d.MediaType.IsImage():
			if d.Platform == nil || (d.Platform.OS == "linux" && d.Platform.Architecture == runtime.GOARCH) {
				return idx.Image(d.Digest)
			}
			if fallback == nil {
				fallback = d
			}
		}
	}
	if fallback != nil {
		return idx.Image(fallback.Digest)
	}
	return nil, errors.New("no image manifest in index")
}

// Open resolves a local source (an OCI image layout directory, an OCI
// archive or a docker archive) or, when reg is set, a registry image to the
// image for linux/GOARCH, as Import reads them; nothing of its layers is
// read yet. scratch is a private directory the caller removes afterwards
// (an OCI archive is unpacked there). For a registry image ctx bounds the
// layer downloads too.
func Open(ctx context.Context, source string, reg *Registry, scratch string) (v1.Image, error) {
	if (source == "") == (reg == nil) {
		return nil, invalid("exactly one of a source and a registry image is required")
	}
	if reg != nil {
		return openRegistry(ctx, *reg)
	}
	img, _, err := openSource(source, scratch)
	return img, err
}
