package testimage

import (
	"archive/tar"
	"context"
	"io"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/cubesandbox/cube/internal/testenv"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

func requireBusybox(t *testing.T) {
	t.Helper()
	if _, err := os.Stat(BusyboxPath); err != nil {
		testenv.Missing(t, "%s missing (apt-get install busybox-static): %v", BusyboxPath, err)
	}
}

func TestBusyboxLayout(t *testing.T) {
	requireBusybox(t)
	ctx := context.Background()
	dir := t.TempDir()
	lay, err := Busybox(ctx, dir)
	if err != nil {
		t.Fatal(err)
	}
	idx, err := layout.ImageIndexFromPath(lay)
	if err != nil {
		t.Fatal(err)
	}
	im, err := idx.IndexManifest()
	if err != nil || len(im.Manifests) != 1 {
		t.Fatalf("index: %v, %v", im, err)
	}
	img, err := idx.Image(im.Manifests[0].Digest)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := BusyboxImage()
	wd, _ := want.Digest()
	if im.Manifests[0].Digest != wd {
		t.Errorf("layout digest %s, in-memory %s", im.Manifests[0].Digest, wd)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(cf.Config.Cmd, []string{"/bin/sh"}) || cf.Config.WorkingDir != "/" || !slices.Equal(cf.Config.Env, BusyboxEnv) {
		t.Errorf("config = %+v", cf.Config)
	}
	files := flatten(t, img)
	for _, want := range []string{"bin/busybox", "bin/sh", "bin/nc", "etc/passwd", "etc/group", "tmp", "root", "home/user"} {
		if _, ok := files[want]; !ok {
			t.Errorf("%s missing from image", want)
		}
	}
	if h := files["tmp"]; h != nil && h.Mode&0o7777 != 0o1777 {
		t.Errorf("/tmp mode %o", h.Mode)
	}
	if h := files["home/user"]; h != nil && h.Uid != 1000 {
		t.Errorf("/home/user uid %d", h.Uid)
	}
	if h := files["bin/sh"]; h != nil && (h.Typeflag != tar.TypeSymlink || h.Linkname != "busybox") {
		t.Errorf("/bin/sh = %+v", h)
	}

	// Cached: a second call must not rewrite.
	st1, _ := os.Stat(filepath.Join(lay, "index.json"))
	if _, err := Busybox(ctx, dir); err != nil {
		t.Fatal(err)
	}
	st2, _ := os.Stat(filepath.Join(lay, "index.json"))
	if !st1.ModTime().Equal(st2.ModTime()) {
		t.Error("second Busybox call rewrote the layout")
	}
}

func TestBusyboxTars(t *testing.T) {
	requireBusybox(t)
	ctx := context.Background()
	dir := t.TempDir()
	want, err := BusyboxImage()
	if err != nil {
		t.Fatal(err)
	}
	wantLayers, _ := want.Layers()
	wantDiff, _ := wantLayers[0].DiffID()

	docker := filepath.Join(dir, "busybox-docker.tar")
	if err := BusyboxDockerTar(ctx, docker); err != nil {
		t.Fatal(err)
	}
	img, err := tarball.ImageFromPath(docker, nil)
	if err != nil {
		t.Fatal(err)
	}
	layers, _ := img.Layers()
	if d, _ := layers[0].DiffID(); d != wantDiff {
		t.Errorf("docker tar layer %s, want %s", d, wantDiff)
	}

	oci := filepath.Join(dir, "busybox-oci.tar")
	if err := BusyboxOCITar(ctx, oci); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(oci)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	names := map[string]bool{}
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		names[h.Name] = true
	}
	if !names["oci-layout"] || !names["index.json"] {
		t.Errorf("OCI tar lacks oci-layout/index.json: %v", names)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 2 {
		t.Errorf("leftover temp files: %v", ents)
	}
}

func flatten(t *testing.T, img v1.Image) map[string]*tar.Header {
	t.Helper()
	rc := mutate.Extract(img)
	defer rc.Close()
	out := map[string]*tar.Header{}
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		out[h.Name] = h
	}
}
