package template

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/loopdev"
	"github.com/cubesandbox/cube/internal/storage"
	"github.com/cubesandbox/cube/internal/testenv"
	"github.com/cubesandbox/cube/internal/testimage"
)

func requireRoot(t *testing.T) {
	t.Helper()
	testenv.RequireRoot(t, "lchown, mknod, loop mounts")
	if _, err := os.Stat(testimage.BusyboxPath); err != nil {
		testenv.Missing(t, "%s missing (busybox-static): %v", testimage.BusyboxPath, err)
	}
}

type env struct {
	work, out, agent string
}

func newEnv(t *testing.T) env {
	dir := t.TempDir()
	e := env{work: filepath.Join(dir, "work"), out: filepath.Join(dir, "out", "rootfs.img"), agent: filepath.Join(dir, "agent")}
	// 0600 on purpose: Import must install it 0755.
	if err := os.WriteFile(e.agent, []byte("#!/bin/sh\necho cube-agent\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return e
}

func (e env) assertWorkDirEmpty(t *testing.T) {
	t.Helper()
	ents, err := os.ReadDir(e.work)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	if len(ents) != 0 {
		t.Errorf("leftovers in WorkDir: %v", ents)
	}
	ents, _ = os.ReadDir(filepath.Dir(e.out))
	for _, d := range ents {
		if d.Name() != filepath.Base(e.out) {
			t.Errorf("leftover next to Output: %s", d.Name())
		}
	}
}

// mountRO mounts img and unmounts it (and checks no loop device stays)
// when the test ends.
func mountRO(t *testing.T, img string) string {
	t.Helper()
	target := filepath.Join(t.TempDir(), "mnt")
	t.Cleanup(func() {
		if err := storage.UnmountDisk(context.Background(), target, img); err != nil {
			t.Errorf("unmount: %v", err)
		}
		if devs, _ := loopdev.FindByBacking(img); len(devs) != 0 {
			t.Errorf("loop devices left: %v", devs)
		}
	})
	if _, err := storage.MountDisk(context.Background(), img, target, true); err != nil {
		t.Fatal(err)
	}
	return target
}

func TestImportBusyboxSources(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	cache := t.TempDir()
	lay, err := testimage.Busybox(ctx, cache)
	if err != nil {
		t.Fatal(err)
	}
	dockerTar := filepath.Join(cache, "docker.tar")
	ociTar := filepath.Join(cache, "oci.tar")
	if err := testimage.BusyboxDockerTar(ctx, dockerTar); err != nil {
		t.Fatal(err)
	}
	if err := testimage.BusyboxOCITar(ctx, ociTar); err != nil {
		t.Fatal(err)
	}
	img, _ := testimage.BusyboxImage()
	wantDigest, _ := img.Digest()
	hostBusybox, _ := os.Stat(testimage.BusyboxPath)

	for _, tc := range []struct {
		name, source string
		sameDigest   bool
	}{
		{"oci-layout", lay, true},
		{"docker-archive", dockerTar, false}, // docker media types: another manifest
		{"oci-archive", ociTar, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			var phases []string
			meta, err := Import(ctx, ImportRequest{Source: tc.source, AgentBinary: e.agent, Output: e.out, WorkDir: e.work},
				func(p Progress) {
					if len(phases) == 0 || phases[len(phases)-1] != p.Phase {
						phases = append(phases, p.Phase)
					}
				})
			if err != nil {
				t.Fatal(err)
			}
			if got := strings.Join(phases, ","); got != "resolve,extract,inject,mkfs,done" {
				t.Errorf("phases = %s", got)
			}
			if tc.sameDigest && meta.Digest != wantDigest.String() {
				t.Errorf("digest %s, want %s", meta.Digest, wantDigest)
			}
			if !strings.HasPrefix(meta.Digest, "sha256:") || len(meta.Cmd) != 1 || meta.Cmd[0] != "/bin/sh" || meta.WorkingDir != "/" || len(meta.Env) != 1 {
				t.Errorf("meta = %+v", meta)
			}
			st, err := os.Stat(e.out)
			if err != nil || st.Size() != meta.SizeBytes || meta.SizeBytes < 64<<20 {
				t.Fatalf("output %v size %d, meta %d", err, st.Size(), meta.SizeBytes)
			}
			e.assertWorkDirEmpty(t)

			root := mountRO(t, e.out)
			bb, err := os.Lstat(filepath.Join(root, "bin/busybox"))
			if err != nil || !bb.Mode().IsRegular() || bb.Size() != hostBusybox.Size() || bb.Mode().Perm() != 0o755 {
				t.Errorf("/bin/busybox: %v %v", bb, err)
			}
			if l, err := os.Readlink(filepath.Join(root, "bin/sh")); err != nil || l != "busybox" {
				t.Errorf("/bin/sh -> %q, %v", l, err)
			}
			ag, err := os.Lstat(filepath.Join(root, AgentPath))
			if err != nil || ag.Mode() != 0o755 || ag.Sys().(*syscall.Stat_t).Uid != 0 {
				t.Errorf("agent: %v %v", ag, err)
			}
			if b, _ := os.ReadFile(filepath.Join(root, AgentPath)); !bytes.Contains(b, []byte("cube-agent")) {
				t.Errorf("agent content %q", b)
			}
			if tmp, err := os.Stat(filepath.Join(root, "tmp")); err != nil || tmp.Mode()&os.ModeSticky == 0 || tmp.Mode().Perm() != 0o777 {
				t.Errorf("/tmp: %v %v", tmp, err)
			}
			if hu, err := os.Stat(filepath.Join(root, "home/user")); err != nil || hu.Sys().(*syscall.Stat_t).Uid != 1000 {
				t.Errorf("/home/user: %v %v", hu, err)
			}
			for _, p := range []string{"proc", "sys", "dev", "run", "etc/hosts", "etc/resolv.conf", "etc/hostname", "etc/passwd"} {
				if _, err := os.Lstat(filepath.Join(root, p)); err != nil {
					t.Errorf("/%s: %v", p, err)
				}
			}
		})
	}
}

// layerFrom builds an uncompressed-tar layer from headers; body is the
// content of regular files.
func layerFrom(t *testing.T, entries ...tar.Header) v1.Layer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, h := range entries {
		body := h.Linkname
		if h.Typeflag == tar.TypeReg {
			h.Linkname, h.Size = "", int64(len(body))
		}
		if h.Mode == 0 {
			h.Mode = 0o644
		}
		if err := tw.WriteHeader(&h); err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			if _, err := tw.Write([]byte(body)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	data := buf.Bytes()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil })
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// TestImportLayersWhiteoutsAndEscapes: whiteouts and opaque dirs are
// applied, hardlinks survive, and an absolute symlink cannot redirect a
// later write out of the rootfs.
func TestImportLayersWhiteoutsAndEscapes(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	hostVictim := filepath.Join(t.TempDir(), "victim")
	if err := os.Mkdir(hostVictim, 0o755); err != nil {
		t.Fatal(err)
	}
	reg := func(name, body string) tar.Header {
		return tar.Header{Typeflag: tar.TypeReg, Name: name, Linkname: body}
	}
	lower := layerFrom(t,
		tar.Header{Typeflag: tar.TypeDir, Name: "etc/", Mode: 0o755},
		reg("etc/secret", "lower"),
		tar.Header{Typeflag: tar.TypeDir, Name: "opq/", Mode: 0o755},
		reg("opq/old", "old"),
		reg("data/a", "shared"),
		tar.Header{Typeflag: tar.TypeReg, Name: "bin/suid", Linkname: "x", Mode: 0o4755},
		tar.Header{Typeflag: tar.TypeSymlink, Name: "escape", Linkname: hostVictim},
		// Same layer, link first: the write must resolve inside the rootfs.
		tar.Header{Typeflag: tar.TypeSymlink, Name: "escape2", Linkname: hostVictim},
		reg("escape2/pwned2", "gotcha"),
		tar.Header{Typeflag: tar.TypeDir, Name: "usr/local/", Mode: 0o755},
		tar.Header{Typeflag: tar.TypeSymlink, Name: "usr/local/bin", Linkname: hostVictim + "/bin"},
	)
	upper := layerFrom(t,
		reg("etc/.wh.secret", ""),
		reg("opq/.wh..wh..opq", ""),
		reg("opq/new", "new"),
		tar.Header{Typeflag: tar.TypeLink, Name: "data/b", Linkname: "data/a"},
		reg("escape/pwned", "gotcha"),
		tar.Header{Typeflag: tar.TypeFifo, Name: "run/fifo", Mode: 0o600},
	)
	img, err := mutate.AppendLayers(empty.Image, lower, upper)
	if err != nil {
		t.Fatal(err)
	}
	src := filepath.Join(t.TempDir(), "layout")
	p, err := layout.Write(src, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.AppendImage(img); err != nil {
		t.Fatal(err)
	}

	e := newEnv(t)
	if _, err := Import(ctx, ImportRequest{Source: src, AgentBinary: e.agent, Output: e.out, WorkDir: e.work}, nil); err != nil {
		t.Fatal(err)
	}
	e.assertWorkDirEmpty(t)
	if ents, _ := os.ReadDir(hostVictim); len(ents) != 0 {
		t.Fatalf("import wrote through a symlink onto the host: %v", ents)
	}
	root := mountRO(t, e.out)
	// The flattener drops entries under a non-directory, so pwned2 may be
	// gone; if present it must be inside the rootfs.
	if b, err := os.ReadFile(filepath.Join(root, hostVictim, "pwned2")); err == nil && string(b) != "gotcha" {
		t.Errorf("pwned2 = %q", b)
	}
	// The agent dir was a dangling absolute symlink: injection
	// must follow them inside the rootfs, never onto the host.
	if b, err := os.ReadFile(filepath.Join(root, hostVictim, "bin", "cube-agent")); err != nil || !bytes.Contains(b, []byte("cube-agent")) {
		t.Errorf("agent not injected through in-root symlink: %q %v", b, err)
	}

	if _, err := os.Lstat(filepath.Join(root, "etc/secret")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("whited-out etc/secret present: %v", err)
	}
	if _, err := os.Lstat(filepath.Join(root, "opq/old")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("opaque dir kept opq/old: %v", err)
	}
	if b, _ := os.ReadFile(filepath.Join(root, "opq/new")); string(b) != "new" {
		t.Errorf("opq/new = %q", b)
	}
	a, errA := os.Stat(filepath.Join(root, "data/a"))
	b, errB := os.Stat(filepath.Join(root, "data/b"))
	if errA != nil || errB != nil || !os.SameFile(a, b) {
		t.Errorf("hardlink lost: %v %v", errA, errB)
	}
	if s, err := os.Stat(filepath.Join(root, "bin/suid")); err != nil || s.Mode()&os.ModeSetuid == 0 {
		t.Errorf("setuid bit lost: %v %v", s, err)
	}
	if f, err := os.Lstat(filepath.Join(root, "run/fifo")); err != nil || f.Mode()&os.ModeNamedPipe == 0 {
		t.Errorf("fifo: %v %v", f, err)
	}
}

func TestImportBadSources(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	dir := t.TempDir()
	garbage := filepath.Join(dir, "garbage.tar")
	if err := os.WriteFile(garbage, bytes.Repeat([]byte("not a tar "), 1000), 0o644); err != nil {
		t.Fatal(err)
	}
	plainDir := filepath.Join(dir, "plain")
	if err := os.Mkdir(plainDir, 0o755); err != nil {
		t.Fatal(err)
	}
	emptyTar := filepath.Join(dir, "other.tar")
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	_ = tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "hello", Size: 2, Mode: 0o644})
	_, _ = tw.Write([]byte("hi"))
	_ = tw.Close()
	if err := os.WriteFile(emptyTar, buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	// A layout whose layer blob was tampered with.
	lay, err := testimage.Busybox(ctx, filepath.Join(dir, "cache"))
	if err != nil {
		t.Fatal(err)
	}
	img, _ := testimage.BusyboxImage()
	layers, _ := img.Layers()
	ld, _ := layers[0].Digest()
	blob := filepath.Join(lay, "blobs", ld.Algorithm, ld.Hex)
	data, err := os.ReadFile(blob)
	if err != nil {
		t.Fatal(err)
	}
	for i := len(data) / 3; i < len(data)/3+4096 && i < len(data); i++ {
		data[i] ^= 0xff
	}
	if err := os.WriteFile(blob, data, 0o644); err != nil {
		t.Fatal(err)
	}

	for name, src := range map[string]string{
		"missing":        filepath.Join(dir, "nope"),
		"garbage":        garbage,
		"dir-not-layout": plainDir,
		"tar-not-image":  emptyTar,
		"tampered-layer": lay,
	} {
		t.Run(name, func(t *testing.T) {
			e := newEnv(t)
			_, err := Import(ctx, ImportRequest{Source: src, AgentBinary: e.agent, Output: e.out, WorkDir: e.work}, nil)
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Fatalf("err = %v, want ErrInvalidArgument", err)
			}
			if _, err := os.Stat(e.out); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("output written for bad source")
			}
			e.assertWorkDirEmpty(t)
		})
	}
}
