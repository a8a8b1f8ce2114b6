package imagebuild

import (
	"archive/tar"
	"context"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"

	"github.com/cubesandbox/cube/internal/template/registrytest"
	"github.com/cubesandbox/cube/internal/testenv"
)

// build makes a two-layer image: busybox-static's package unpacked, and a
// file layer of a host file whose mtime and owner differ between calls.
func build(t *testing.T, deb string, data string) v1.Image {
	t.Helper()
	tmp := t.TempDir()
	src := filepath.Join(tmp, "tool")
	if err := os.WriteFile(src, []byte(data), 0o700); err != nil {
		t.Fatal(err)
	}
	// The host file's time and owner must not reach the image.
	now := time.Now()
	if err := os.Chtimes(src, now, now); err != nil {
		t.Fatal(err)
	}
	_ = os.Chown(src, 1234+int(now.UnixNano()%1000), 1234) // root only; the tar must say 0:0 regardless
	dl, err := DebLayer(context.Background(), tmp, []string{deb})
	if err != nil {
		t.Fatal(err)
	}
	fl, err := FilesLayer(tmp, []Entry{
		{Path: "usr/local/bin/tool", Src: src},
		{Path: "etc/cube/config.toml", Data: []byte("x = 1\n")},
		{Path: "bin/sh", Link: "busybox"},
		{Path: "var/lib/cube", Dir: true},
	})
	if err != nil {
		t.Fatal(err)
	}
	img, err := Image(Spec{Name: "cube/test", Layers: []v1.Layer{dl, fl}, Entrypoint: []string{"/usr/local/bin/tool"}})
	if err != nil {
		t.Fatal(err)
	}
	return img
}

func digest(t *testing.T, img v1.Image) v1.Hash {
	t.Helper()
	d, err := img.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// TestReproducible builds the same image twice, a second apart, from the
// same inputs in different directories: the digests must match. The
// control changes one byte of one input: the digest must change (the
// comparison can tell images apart).
func TestReproducible(t *testing.T) {
	testenv.RequireBinary(t, "apt-get", "apt")
	testenv.RequireBinary(t, "dpkg-deb", "dpkg")
	names, err := Resolve(context.Background(), []string{"busybox-static"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(names) != 1 || names[0] != "busybox-static" {
		t.Fatalf("busybox-static's closure: %v, want itself alone", names)
	}
	debs, err := Download(context.Background(), filepath.Join(os.TempDir(), "cube-imagebuild-debs"), names)
	if err != nil {
		testenv.Missing(t, "apt-get download busybox-static: %v", err)
	}
	a := digest(t, build(t, debs[0], "v1"))
	time.Sleep(1100 * time.Millisecond)
	b := digest(t, build(t, debs[0], "v1"))
	if a != b {
		t.Fatalf("same inputs, digests %s and %s", a, b)
	}
	c := digest(t, build(t, debs[0], "v2"))
	if c == a {
		t.Fatalf("a changed input kept digest %s", a)
	}
	t.Logf("same inputs: %s both times; one byte changed: %s", a, c)

	// Every entry carries the fixed time and root ownership; parents come
	// before children; the package's documentation is left out.
	img := build(t, debs[0], "v1")
	ls, _ := img.Layers()
	seen := map[string]bool{}
	for i, l := range ls {
		rc, err := l.Uncompressed()
		if err != nil {
			t.Fatal(err)
		}
		tr := tar.NewReader(rc)
		for {
			h, err := tr.Next()
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			if !h.ModTime.Equal(Epoch) || h.Uid != 0 || h.Gid != 0 {
				t.Errorf("layer %d %s: time %s owner %d:%d", i, h.Name, h.ModTime, h.Uid, h.Gid)
			}
			if dir := filepath.Dir(filepath.Clean(h.Name)); dir != "." && !seen[dir] {
				t.Errorf("layer %d %s comes before its directory %s", i, h.Name, dir)
			}
			if filepath.Dir(h.Name) == "usr/share/doc" {
				t.Errorf("layer %d carries %s", i, h.Name)
			}
			seen[filepath.Clean(h.Name)] = true
		}
		rc.Close()
	}
	for _, want := range []string{"bin/busybox", "usr/local/bin/tool", "bin/sh", "var/lib/cube"} {
		if !seen[want] {
			t.Errorf("no %s in the image", want)
		}
	}
}

// TestLayoutAndPush writes an image into an OCI layout under its ref
// name, imports nothing twice, pushes it to a loopback registry and reads
// the same digest back from both.
func TestLayoutAndPush(t *testing.T) {
	tmp := t.TempDir()
	l, err := FilesLayer(tmp, []Entry{{Path: "hello", Data: []byte("hi\n")}})
	if err != nil {
		t.Fatal(err)
	}
	img, err := Image(Spec{Name: "cube/hello", Layers: []v1.Layer{l}})
	if err != nil {
		t.Fatal(err)
	}
	want := digest(t, img)
	dir := filepath.Join(tmp, "layout")
	for range 2 { // a second write replaces, not appends
		if _, err := WriteLayout(dir, map[string]v1.Image{"cube/hello:1": img}); err != nil {
			t.Fatal(err)
		}
	}
	p, err := layout.FromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	idx, err := p.ImageIndex()
	if err != nil {
		t.Fatal(err)
	}
	m, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Manifests) != 1 || m.Manifests[0].Digest != want || m.Manifests[0].Annotations["org.opencontainers.image.ref.name"] != "cube/hello:1" {
		t.Fatalf("layout index: %+v, want one %s named cube/hello:1", m.Manifests, want)
	}
	reg := registrytest.Start(t, registrytest.Options{})
	got, err := Push(context.Background(), img, reg.Host+"/cube/hello:1")
	if err != nil {
		t.Fatal(err)
	}
	if got != want {
		t.Fatalf("pushed %s, built %s", got, want)
	}
}
