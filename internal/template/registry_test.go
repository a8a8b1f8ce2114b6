package template

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/template/registrytest"
	"github.com/cubesandbox/cube/internal/testimage"
)

// importFrom runs Import from reg into a fresh env and checks that a
// failure leaves nothing behind.
func importFrom(t *testing.T, reg Registry, progress func(Progress)) (Meta, error) {
	t.Helper()
	e := newEnv(t)
	meta, err := Import(context.Background(), ImportRequest{Registry: &reg, AgentBinary: e.agent, Output: e.out, WorkDir: e.work}, progress)
	e.assertWorkDirEmpty(t)
	if err != nil {
		if _, serr := os.Stat(e.out); !errors.Is(serr, os.ErrNotExist) {
			t.Errorf("failed import left its output: %v", serr)
		}
	}
	return meta, err
}

// paddedImage has one uncompressed layer whose tar is followed by 16 KiB
// of zeros: legal, and never read by a tar reader, so only a verifier that
// drains the blob notices when that tail is tampered with.
func paddedImage(t *testing.T, arch string) (v1.Image, v1.Hash) {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	body := []byte("#!/bin/sh\necho padded\n")
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "bin/hello", Mode: 0o755, Size: int64(len(body))}); err != nil {
		t.Fatal(err)
	}
	_, _ = tw.Write(body)
	_ = tw.Close()
	buf.Write(make([]byte, 16<<10))
	layer := static.NewLayer(buf.Bytes(), types.OCIUncompressedLayer)
	base := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img, err := mutate.AppendLayers(base, layer)
	if err != nil {
		t.Fatal(err)
	}
	cf, _ := img.ConfigFile()
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", arch
	cf.Config.Cmd = []string{"/bin/hello"}
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		t.Fatal(err)
	}
	d, _ := layer.Digest()
	return img, d
}

func tamper(t *testing.T, path string, at func(size int) int) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	i := at(len(data))
	data[i] ^= 0xff
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestRegistryImport(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	reg := registrytest.Start(t, registrytest.Options{})
	bb, err := testimage.BusyboxImage()
	if err != nil {
		t.Fatal(err)
	}
	bbDigest, _ := bb.Digest()
	pinned, err := reg.Push(ctx, "busybox:1", bb)
	if err != nil {
		t.Fatal(err)
	}
	layers, _ := bb.Layers()
	layerSize, _ := layers[0].Size()

	t.Run("by tag", func(t *testing.T) {
		var events []Progress
		meta, err := importFrom(t, Registry{Ref: reg.Ref("busybox:1"), Insecure: true}, func(p Progress) { events = append(events, p) })
		if err != nil {
			t.Fatal(err)
		}
		if meta.Digest != bbDigest.String() || len(meta.Cmd) != 1 || meta.Cmd[0] != "/bin/sh" || meta.WorkingDir != "/" {
			t.Errorf("meta = %+v", meta)
		}
		var phases []string
		var last Progress
		for _, p := range events {
			if len(phases) == 0 || phases[len(phases)-1] != p.Phase {
				phases = append(phases, p.Phase)
			}
			if p.Phase == "extract" {
				last = p
			}
		}
		if got := strings.Join(phases, ","); got != "resolve,extract,inject,mkfs,done" {
			t.Errorf("phases = %s", got)
		}
		// The 2 MB busybox layer compresses to ~1 MB: at least the
		// layer-open event and the final count are reported.
		if last.Layer != 1 || last.Layers != 1 || last.Total != layerSize {
			t.Errorf("last extract progress %+v, want layer 1/1 of %d bytes", last, layerSize)
		}
		if fin := events[len(events)-1]; fin.Phase != "done" || fin.Bytes != layerSize {
			t.Errorf("final progress %+v, want %d bytes", fin, layerSize)
		}
	})

	t.Run("by digest", func(t *testing.T) {
		meta, err := importFrom(t, Registry{Ref: pinned, Insecure: true}, nil)
		if err != nil || meta.Digest != bbDigest.String() {
			t.Fatalf("import %s: %v %+v", pinned, err, meta)
		}
	})

	t.Run("platform from index", func(t *testing.T) {
		other := "arm64"
		if runtime.GOARCH == "arm64" {
			other = "amd64"
		}
		foreign, _ := paddedImage(t, other)
		idx := mutate.AppendManifests(mutate.IndexMediaType(empty.Index, types.OCIImageIndex),
			mutate.IndexAddendum{Add: foreign, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: other}}},
			mutate.IndexAddendum{Add: bb, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: runtime.GOARCH}}},
		)
		if err := reg.PushIndex(ctx, "multi:1", idx); err != nil {
			t.Fatal(err)
		}
		meta, err := importFrom(t, Registry{Ref: reg.Ref("multi:1"), Insecure: true}, nil)
		if err != nil || meta.Digest != bbDigest.String() {
			t.Fatalf("index import picked %v (%v), want %s", meta.Digest, err, bbDigest)
		}
		only := mutate.AppendManifests(mutate.IndexMediaType(empty.Index, types.OCIImageIndex),
			mutate.IndexAddendum{Add: foreign, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: other}}})
		if err := reg.PushIndex(ctx, "foreign:1", only); err != nil {
			t.Fatal(err)
		}
		if _, err := importFrom(t, Registry{Ref: reg.Ref("foreign:1"), Insecure: true}, nil); !errdefs.IsInvalidArgument(err) {
			t.Errorf("index without linux/%s: %v, want InvalidArgument", runtime.GOARCH, err)
		}
		if _, err := reg.Push(ctx, "foreign:single", foreign); err != nil {
			t.Fatal(err)
		}
		if _, err := importFrom(t, Registry{Ref: reg.Ref("foreign:single"), Insecure: true}, nil); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), other) {
			t.Errorf("single %s image: %v, want InvalidArgument", other, err)
		}
	})

	for _, tc := range []struct {
		name string
		reg  Registry
		want error
		msg  string
	}{
		{"missing tag", Registry{Ref: reg.Ref("busybox:nope"), Insecure: true}, errdefs.ErrNotFound, "MANIFEST_UNKNOWN"},
		{"missing repo", Registry{Ref: reg.Ref("nothing:1"), Insecure: true}, errdefs.ErrNotFound, ""},
		{"wrong pinned digest", Registry{Ref: reg.Ref("busybox") + "@sha256:" + strings.Repeat("ab", 32), Insecure: true}, errdefs.ErrNotFound, ""},
		{"plain http without insecure", Registry{Ref: reg.Ref("busybox:1")}, errdefs.ErrInvalidArgument, "insecure"},
		{"unreachable", Registry{Ref: "127.0.0.1:1/busybox:1", Insecure: true}, errdefs.ErrUnavailable, ""},
		{"bad reference", Registry{Ref: "UPPER/Case::x", Insecure: true}, errdefs.ErrInvalidArgument, "reference"},
		{"password without user", Registry{Ref: reg.Ref("busybox:1"), Password: "x"}, errdefs.ErrInvalidArgument, "username"},
		{"password and token", Registry{Ref: reg.Ref("busybox:1"), Username: "u", Password: "x", Token: "y"}, errdefs.ErrInvalidArgument, "not both"},
		{"user without secret", Registry{Ref: reg.Ref("busybox:1"), Username: "u"}, errdefs.ErrInvalidArgument, "without a password"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := importFrom(t, tc.reg, nil)
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.msg) {
				t.Fatalf("err = %v, want %v containing %q", err, tc.want, tc.msg)
			}
		})
	}

	// Tampering last: blobs are shared by every repository of the registry.
	t.Run("tampered compressed layer", func(t *testing.T) {
		d, _ := layers[0].Digest()
		tamper(t, reg.BlobPath(d), func(n int) int { return n / 2 })
		_, err := importFrom(t, Registry{Ref: pinned, Insecure: true}, nil)
		if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "does not match its digest") || !strings.Contains(err.Error(), d.String()) {
			t.Fatalf("err = %v, want a digest mismatch for %s", err, d)
		}
	})
	t.Run("tampered tail of an uncompressed layer", func(t *testing.T) {
		img, d := paddedImage(t, runtime.GOARCH)
		ref, err := reg.Push(ctx, "padded:1", img)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := importFrom(t, Registry{Ref: ref, Insecure: true}, nil); err != nil {
			t.Fatalf("untampered: %v", err)
		}
		tamper(t, reg.BlobPath(d), func(n int) int { return n - 1 })
		_, err = importFrom(t, Registry{Ref: ref, Insecure: true}, nil)
		if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "does not match its digest") {
			t.Fatalf("err = %v, want a digest mismatch", err)
		}
	})
}

// TestLayoutTamperedTail: an OCI layout has no verifier but ours.
func TestLayoutTamperedTail(t *testing.T) {
	requireRoot(t)
	img, d := paddedImage(t, runtime.GOARCH)
	dir := filepath.Join(t.TempDir(), "layout")
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.AppendImage(img); err != nil {
		t.Fatal(err)
	}
	e := newEnv(t)
	if _, err := Import(context.Background(), ImportRequest{Source: dir, AgentBinary: e.agent, Output: e.out, WorkDir: e.work}, nil); err != nil {
		t.Fatal(err)
	}
	tamper(t, filepath.Join(dir, "blobs", d.Algorithm, d.Hex), func(n int) int { return n - 1 })
	e = newEnv(t)
	_, err = Import(context.Background(), ImportRequest{Source: dir, AgentBinary: e.agent, Output: e.out, WorkDir: e.work}, nil)
	if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "does not match its digest") {
		t.Fatalf("err = %v, want a digest mismatch", err)
	}
	e.assertWorkDirEmpty(t)
	if _, err := os.Stat(e.out); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("output written: %v", err)
	}
}

func TestRegistryAuth(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	reg := registrytest.Start(t, registrytest.Options{Username: "alice", Password: "s3cret"})
	bb, err := testimage.BusyboxImage()
	if err != nil {
		t.Fatal(err)
	}
	pinned, err := reg.Push(ctx, "private/busybox:1", bb)
	if err != nil {
		t.Fatal(err)
	}
	authFile := func(user, pass string) string {
		f := filepath.Join(t.TempDir(), "config.json")
		body := fmt.Sprintf(`{"auths":{%q:{"auth":%q}}}`, reg.Host, base64.StdEncoding.EncodeToString([]byte(user+":"+pass)))
		if err := os.WriteFile(f, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return f
	}
	for _, tc := range []struct {
		name string
		reg  Registry
		want error // nil: succeeds
	}{
		{"anonymous", Registry{}, errdefs.ErrUnauthenticated},
		{"wrong password", Registry{Username: "alice", Password: "nope"}, errdefs.ErrUnauthenticated},
		{"unknown user", Registry{Username: "bob", Password: "s3cret"}, errdefs.ErrUnauthenticated},
		{"bearer token the registry does not issue", Registry{Token: "abc"}, errdefs.ErrUnauthenticated},
		{"password", Registry{Username: "alice", Password: "s3cret"}, nil},
		{"token as password", Registry{Username: "alice", Token: "s3cret"}, nil},
		{"auth file", Registry{AuthFile: authFile("alice", "s3cret")}, nil},
		{"auth file with wrong password", Registry{AuthFile: authFile("alice", "bad")}, errdefs.ErrUnauthenticated},
		{"request beats auth file", Registry{Username: "alice", Password: "s3cret", AuthFile: authFile("alice", "bad")}, nil},
		{"auth file missing", Registry{AuthFile: "/nonexistent/config.json"}, errdefs.ErrFailedPrecondition},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := tc.reg
			r.Ref, r.Insecure = pinned, true
			meta, err := importFrom(t, r, nil)
			if tc.want == nil {
				if err != nil {
					t.Fatal(err)
				}
				if d, _ := bb.Digest(); meta.Digest != d.String() {
					t.Errorf("digest %s", meta.Digest)
				}
				return
			}
			if !errors.Is(err, tc.want) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
			if strings.Contains(err.Error(), "s3cret") {
				t.Errorf("error leaks the password: %v", err)
			}
		})
	}
}
