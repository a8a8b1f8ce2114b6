package integration

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/template"
	"github.com/cubesandbox/cube/internal/template/registrytest"
	"github.com/cubesandbox/cube/internal/testimage"
)

// importPhases imports and returns the distinct phases reported.
func importPhases(ctx context.Context, svc *cubelet.Service, req cubelet.TemplateImport) ([]string, error) {
	var phases []string
	_, err := svc.ImportTemplateFrom(ctx, req, func(p template.Progress) {
		if len(phases) == 0 || phases[len(phases)-1] != p.Phase {
			phases = append(phases, p.Phase)
		}
	})
	return phases, err
}

// assertTemplateFiles checks that the pool holds a directory for every
// template record and nothing else, and no import scratch.
func assertTemplateFiles(t *testing.T, env *cubelettest.Env, svc *cubelet.Service) {
	t.Helper()
	tmpls, err := svc.ListTemplates(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var want, got []string
	for _, tp := range tmpls {
		want = append(want, tp.ID)
	}
	ents, _ := os.ReadDir(filepath.Join(env.Config.PoolDir(), "templates"))
	for _, e := range ents {
		got = append(got, e.Name())
	}
	if !slices.Equal(want, got) {
		t.Errorf("template dirs %v, records %v", got, want)
	}
	if ents, _ := os.ReadDir(filepath.Join(env.Config.PoolDir(), "tmp")); len(ents) != 0 {
		t.Errorf("import scratch left: %v", ents)
	}
}

// layerWithFile is a gzip layer holding one file.
func layerWithFile(t *testing.T, name, body string) v1.Layer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644, Size: int64(len(body))}); err != nil {
		t.Fatal(err)
	}
	_, _ = tw.Write([]byte(body))
	_ = tw.Close()
	data := buf.Bytes()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil })
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func freeBytes(t *testing.T, dir string) int64 {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	return int64(st.Bavail) * st.Bsize
}

func TestTemplateImportRegistryAndDedupe(t *testing.T) {
	env := cubelettest.New(t, "")
	svc := env.Start(t)
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

	// From the registry, by tag.
	phases, err := importPhases(ctx, svc, cubelet.TemplateImport{TemplateID: "bb-reg", ImageRef: reg.Ref("busybox:1"), Insecure: true})
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(phases, ","); got != "resolve,extract,inject,mkfs,done" {
		t.Errorf("phases %s", got)
	}
	first, err := svc.GetTemplate(ctx, "bb-reg")
	if err != nil || first.Digest != bbDigest.String() || first.Source != reg.Ref("busybox:1") || !strings.HasPrefix(first.AgentDigest, "sha256:") {
		t.Fatalf("record %+v %v", first, err)
	}

	// The same image from a local layout under another ID: cloned, not
	// extracted, and sharing its blocks.
	free := freeBytes(t, env.Config.PoolDir())
	phases, err = importPhases(ctx, svc, cubelet.TemplateImport{TemplateID: "bb-local", Source: env.Image})
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(phases, ","); got != "resolve,reuse,done" {
		t.Errorf("dedupe phases %s, want resolve,reuse,done", got)
	}
	if used := free - freeBytes(t, env.Config.PoolDir()); used > 4<<20 {
		t.Errorf("reused template took %d bytes of the pool", used)
	}
	second, _ := svc.GetTemplate(ctx, "bb-local")
	a, _ := os.ReadFile(first.ImagePath)
	b, _ := os.ReadFile(second.ImagePath)
	sa, _ := os.Stat(first.ImagePath)
	sb, _ := os.Stat(second.ImagePath)
	if !bytes.Equal(a, b) || os.SameFile(sa, sb) || second.Digest != first.Digest || second.SizeBytes != first.SizeBytes ||
		second.Source != env.Image || !slices.Equal(second.Cmd, first.Cmd) {
		t.Errorf("reused template differs: %+v vs %+v", second, first)
	}

	// Idempotent: the same ID and image again is the existing template.
	for _, req := range []cubelet.TemplateImport{
		{TemplateID: "bb-reg", ImageRef: pinned, Insecure: true},
		{TemplateID: "bb-reg", Source: env.Image},
	} {
		phases, err := importPhases(ctx, svc, req)
		again, gerr := svc.GetTemplate(ctx, "bb-reg")
		if err != nil || gerr != nil || !again.CreatedAt.Equal(first.CreatedAt) || strings.Join(phases, ",") != "resolve,done" {
			t.Errorf("re-import %+v: %v %v, phases %v", req, err, again, phases)
		}
	}
	// The same ID with another image is refused.
	dockerTar := filepath.Join(env.Dir, "busybox-docker.tar")
	if err := testimage.BusyboxDockerTar(ctx, dockerTar); err != nil {
		t.Fatal(err)
	}
	if _, err := svc.ImportTemplate(ctx, "bb-reg", dockerTar, nil); !errdefs.IsAlreadyExists(err) {
		t.Errorf("same ID, other digest: %v, want AlreadyExists", err)
	}

	// A reused template boots.
	res, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "bb-local", SandboxID: "from-reuse"})
	if err != nil {
		t.Fatalf("create from reused template: %v", err)
	}
	if _, err := svc.Delete(ctx, res.Sandbox.ID); err != nil {
		t.Fatal(err)
	}
	// Deleting the original leaves the clone intact and reusable.
	if err := svc.DeleteTemplate(ctx, "bb-reg"); err != nil {
		t.Fatal(err)
	}
	if phases, err := importPhases(ctx, svc, cubelet.TemplateImport{TemplateID: "bb-third", ImageRef: pinned, Insecure: true}); err != nil || !slices.Contains(phases, "reuse") {
		t.Errorf("reuse from the surviving clone: %v %v", phases, err)
	}

	// A different agent means a different image: no reuse.
	agent := filepath.Join(env.Dir, "agent-v2")
	data, err := os.ReadFile(env.AgentBin)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(agent, append(data, 0), 0o755); err != nil {
		t.Fatal(err)
	}
	svc.Config().Storage.AgentBinary = agent
	t.Cleanup(func() { svc.Config().Storage.AgentBinary = env.AgentBin })
	if phases, err := importPhases(ctx, svc, cubelet.TemplateImport{TemplateID: "bb-agent2", Source: env.Image}); err != nil || !slices.Contains(phases, "extract") {
		t.Errorf("new agent: %v %v, want a fresh extract", phases, err)
	}
	svc.Config().Storage.AgentBinary = env.AgentBin
	assertTemplateFiles(t, env, svc)
}

// TestTemplateImportFailures: every failure leaves no record, no template
// directory and no scratch.
func TestTemplateImportFailures(t *testing.T) {
	env := cubelettest.New(t, "")
	svc := env.Start(t)
	ctx := context.Background()
	reg := registrytest.Start(t, registrytest.Options{Username: "ci", Password: "pw"})
	bb, _ := testimage.BusyboxImage()
	pinned, err := reg.Push(ctx, "private/busybox:1", bb)
	if err != nil {
		t.Fatal(err)
	}
	// Another image (its own layer digests) to tamper with.
	cf, _ := bb.ConfigFile()
	cf = cf.DeepCopy()
	cf.Config.Env = append(cf.Config.Env, "TAMPERED=1")
	other, err := mutate.ConfigFile(bb, cf)
	if err != nil {
		t.Fatal(err)
	}
	noise := layerWithFile(t, "etc/noise", strings.Repeat("cube ", 1<<16))
	other, err = mutate.AppendLayers(other, noise)
	if err != nil {
		t.Fatal(err)
	}
	otherRef, err := reg.Push(ctx, "private/other:1", other)
	if err != nil {
		t.Fatal(err)
	}
	nd, _ := noise.Digest()
	blob := reg.BlobPath(nd)
	data, err := os.ReadFile(blob)
	if err != nil {
		t.Fatal(err)
	}
	data[len(data)/2] ^= 0xff
	if err := os.WriteFile(blob, data, 0o644); err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		name string
		req  cubelet.TemplateImport
		fp   string
		want error
	}{
		{"no source", cubelet.TemplateImport{TemplateID: "x"}, "", errdefs.ErrInvalidArgument},
		{"both sources", cubelet.TemplateImport{TemplateID: "x", Source: env.Image, ImageRef: pinned}, "", errdefs.ErrInvalidArgument},
		{"auth on a local source", cubelet.TemplateImport{TemplateID: "x", Source: env.Image, Username: "ci", Password: "pw"}, "", errdefs.ErrInvalidArgument},
		{"bad id", cubelet.TemplateImport{TemplateID: "Bad_ID", ImageRef: pinned}, "", errdefs.ErrInvalidArgument},
		{"artifact and a source", cubelet.TemplateImport{TemplateID: "x", Artifact: "sha256:" + strings.Repeat("0", 64), Source: env.Image}, "", errdefs.ErrInvalidArgument},
		{"artifact without a master", cubelet.TemplateImport{TemplateID: "x", Artifact: "sha256:" + strings.Repeat("0", 64)}, "", errdefs.ErrFailedPrecondition},
		{"no credentials", cubelet.TemplateImport{TemplateID: "x", ImageRef: pinned, Insecure: true}, "", errdefs.ErrUnauthenticated},
		{"wrong password", cubelet.TemplateImport{TemplateID: "x", ImageRef: pinned, Insecure: true, Username: "ci", Password: "nope"}, "", errdefs.ErrUnauthenticated},
		{"plain http refused", cubelet.TemplateImport{TemplateID: "x", ImageRef: pinned, Username: "ci", Password: "pw"}, "", errdefs.ErrInvalidArgument},
		{"tampered layer", cubelet.TemplateImport{TemplateID: "x", ImageRef: otherRef, Insecure: true, Username: "ci", Password: "pw"}, "", errdefs.ErrInvalidArgument},
		{"fail after build", cubelet.TemplateImport{TemplateID: "x", ImageRef: pinned, Insecure: true, Username: "ci", Password: "pw"}, cubelet.FailpointTemplateBuilt, failpoint.ErrInjected},
		{"fail after record", cubelet.TemplateImport{TemplateID: "x", Source: env.Image}, cubelet.FailpointTemplateRecord, failpoint.ErrInjected},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.fp != "" {
				if err := failpoint.Enable(tc.fp, "error"); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { failpoint.Disable(tc.fp) })
			}
			_, err := svc.ImportTemplateFrom(ctx, tc.req, nil)
			if !errors.Is(err, tc.want) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
			if _, err := svc.GetTemplate(ctx, "x"); !errdefs.IsNotFound(err) {
				t.Errorf("record after a failed import: %v", err)
			}
			assertTemplateFiles(t, env, svc)
		})
	}

	// The reuse path: a failure after the clone removes it too.
	if _, err := svc.ImportTemplateFrom(ctx, cubelet.TemplateImport{TemplateID: "keep", Source: env.Image}, nil); err != nil {
		t.Fatal(err)
	}
	if err := failpoint.Enable(cubelet.FailpointTemplateReused, "error"); err != nil {
		t.Fatal(err)
	}
	_, err = svc.ImportTemplateFrom(ctx, cubelet.TemplateImport{TemplateID: "x", ImageRef: pinned, Insecure: true, Username: "ci", Password: "pw"}, nil)
	failpoint.Disable(cubelet.FailpointTemplateReused)
	if !errors.Is(err, failpoint.ErrInjected) {
		t.Fatalf("reuse failpoint: %v", err)
	}
	assertTemplateFiles(t, env, svc)
	if st, err := os.Stat(filepath.Join(env.Config.PoolDir(), "templates", "keep", "rootfs.img")); err != nil || st.Sys().(*syscall.Stat_t).Nlink != 1 {
		t.Errorf("reuse source damaged: %v", err)
	}
}
