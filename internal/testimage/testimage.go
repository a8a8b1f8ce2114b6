// Package testimage builds small OCI test images on the local machine, so
// no test depends on a registry or the internet.
//
// The busybox image is one layer made from the host's static busybox
// (/bin/busybox, Debian package busybox-static) with a fixed timestamp, so
// the same host binary always yields the same digest. Builders write to a
// temporary name and rename, and return at once when the output exists, so
// concurrent test packages can share one cache directory.
package testimage

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// BusyboxPath is the host binary the image is made from.
const BusyboxPath = "/bin/busybox"

// BusyboxRef is the reference recorded in the tar outputs and in the
// layout's org.opencontainers.image.ref.name annotation.
const BusyboxRef = "cube.test/busybox:latest"

// BusyboxApplets get a /bin/<name> -> busybox symlink.
var BusyboxApplets = []string{
	"sh", "ls", "cat", "echo", "sleep", "mkdir", "rm", "cp", "mv", "ps", "kill",
	"true", "false", "env", "id", "wc", "head", "tail", "grep", "sed", "sync",
	"date", "hostname", "dd", "stat", "touch", "uname", "mount", "top", "vi",
	"wget", "nc",
}

// BusyboxEnv is the image config's Env.
var BusyboxEnv = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}

// epoch fixes every timestamp so the layer digest is stable.
var epoch = time.Date(2024, 1, 1, 0, 0, 0, 0, time.UTC)

var (
	buildMu  sync.Mutex
	imgOnce  sync.Once
	imgValue v1.Image
	imgErr   error
)

// BusyboxImage returns the in-memory busybox image (built once per process).
func BusyboxImage() (v1.Image, error) {
	imgOnce.Do(func() { imgValue, imgErr = buildBusybox() })
	return imgValue, imgErr
}

func buildBusybox() (v1.Image, error) {
	bin, err := os.ReadFile(BusyboxPath)
	if err != nil {
		return nil, fmt.Errorf("testimage: %s (install busybox-static): %w", BusyboxPath, errdefs.ErrFailedPrecondition)
	}
	layerTar, err := busyboxLayerTar(bin)
	if err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, fmt.Errorf("testimage: layer: %w", err)
	}
	base := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	base = mutate.ConfigMediaType(base, types.OCIConfigJSON)
	img, err := mutate.AppendLayers(base, layer)
	if err != nil {
		return nil, fmt.Errorf("testimage: append layer: %w", err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, fmt.Errorf("testimage: config: %w", err)
	}
	cf = cf.DeepCopy()
	cf.Architecture = runtime.GOARCH
	cf.OS = "linux"
	cf.Created = v1.Time{Time: epoch}
	cf.Config.Env = BusyboxEnv
	cf.Config.Cmd = []string{"/bin/sh"}
	cf.Config.WorkingDir = "/"
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		return nil, fmt.Errorf("testimage: set config: %w", err)
	}
	return img, nil
}

func busyboxLayerTar(bin []byte) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	hdr := func(h *tar.Header) error {
		h.ModTime = epoch
		h.Format = tar.FormatPAX
		if h.Typeflag == tar.TypeDir {
			h.Name += "/"
		}
		return tw.WriteHeader(h)
	}
	dir := func(name string, mode int64, uid int) error {
		return hdr(&tar.Header{Typeflag: tar.TypeDir, Name: name, Mode: mode, Uid: uid, Gid: uid})
	}
	file := func(name string, mode int64, data []byte) error {
		if err := hdr(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: mode, Size: int64(len(data))}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	steps := []func() error{
		func() error { return dir("bin", 0o755, 0) },
		func() error { return file("bin/busybox", 0o755, bin) },
		func() error {
			for _, a := range BusyboxApplets {
				if err := hdr(&tar.Header{Typeflag: tar.TypeSymlink, Name: "bin/" + a, Linkname: "busybox", Mode: 0o777}); err != nil {
					return err
				}
			}
			return nil
		},
		func() error { return dir("etc", 0o755, 0) },
		func() error {
			return file("etc/passwd", 0o644, []byte("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n"))
		},
		func() error { return file("etc/group", 0o644, []byte("root:x:0:\nuser:x:1000:\n")) },
		func() error { return dir("tmp", 0o1777, 0) },
		func() error { return dir("root", 0o700, 0) },
		func() error { return dir("home", 0o755, 0) },
		func() error { return dir("home/user", 0o755, 1000) },
		tw.Close,
	}
	for _, s := range steps {
		if err := s(); err != nil {
			return nil, fmt.Errorf("testimage: build layer: %w", err)
		}
	}
	return buf.Bytes(), nil
}

// Busybox writes the busybox image as an OCI image layout in dir/busybox-oci
// and returns that path. An existing layout there is reused.
func Busybox(ctx context.Context, dir string) (string, error) {
	out := filepath.Join(dir, "busybox-oci")
	err := buildOnce(ctx, out, func(tmp string) error {
		return writeLayout(tmp)
	})
	return out, err
}

// BusyboxDockerTar writes the busybox image as a docker-archive tarball
// (`docker save` format) at path, unless path already exists.
func BusyboxDockerTar(ctx context.Context, path string) error {
	return buildOnce(ctx, path, func(tmp string) error {
		img, err := BusyboxImage()
		if err != nil {
			return err
		}
		ref, err := name.ParseReference(BusyboxRef)
		if err != nil {
			return err
		}
		return tarball.WriteToFile(tmp, ref, img)
	})
}

// BusyboxOCITar writes the busybox image as a tar of an OCI image layout
// (`skopeo copy oci-archive:` format) at path, unless path already exists.
func BusyboxOCITar(ctx context.Context, path string) error {
	return buildOnce(ctx, path, func(tmp string) error {
		lay := tmp + ".layout"
		defer os.RemoveAll(lay)
		if err := writeLayout(lay); err != nil {
			return err
		}
		return tarDir(lay, tmp)
	})
}

func writeLayout(dir string) error {
	img, err := BusyboxImage()
	if err != nil {
		return err
	}
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return err
	}
	return p.AppendImage(img, layout.WithAnnotations(map[string]string{
		"org.opencontainers.image.ref.name": BusyboxRef,
	}))
}

// buildOnce runs build into a temporary sibling of out and renames it into
// place, so out is either absent or complete.
func buildOnce(ctx context.Context, out string, build func(tmp string) error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	buildMu.Lock()
	defer buildMu.Unlock()
	if _, err := os.Stat(out); err == nil {
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return fmt.Errorf("testimage: %w", err)
	}
	tmp := fmt.Sprintf("%s.tmp-%d", out, os.Getpid())
	_ = os.RemoveAll(tmp)
	defer os.RemoveAll(tmp)
	if err := build(tmp); err != nil {
		return fmt.Errorf("testimage: build %s: %w", out, err)
	}
	if err := os.Rename(tmp, out); err != nil {
		if _, serr := os.Stat(out); serr == nil {
			return nil // another process won the race with the same content
		}
		return fmt.Errorf("testimage: %w", err)
	}
	return nil
}

// tarDir writes the regular files and directories under dir as a tar.
func tarDir(dir, out string) (err error) {
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}()
	tw := tar.NewWriter(f)
	err = filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err != nil || p == dir {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		h, err := tar.FileInfoHeader(fi, "")
		if err != nil {
			return err
		}
		h.Name = filepath.ToSlash(rel)
		if fi.IsDir() {
			h.Name += "/"
		}
		h.ModTime, h.Uname, h.Gname, h.Uid, h.Gid = epoch, "", "", 0, 0
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if !fi.Mode().IsRegular() {
			return nil
		}
		src, err := os.Open(p)
		if err != nil {
			return err
		}
		defer src.Close()
		_, err = io.Copy(tw, src)
		return err
	})
	if err != nil {
		return err
	}
	return tw.Close()
}
