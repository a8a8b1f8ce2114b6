package baseimage

import (
	"archive/tar"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/cubesandbox/cube/internal/testenv"
	"golang.org/x/sys/unix"
)

// TestPackDir: the tar carries owners, modes, links, devices and xattrs as
// they are on disk, skips what it is told to, and its digest is the file's.
func TestPackDir(t *testing.T) {
	testenv.RequireRoot(t, "chown and mknod")
	root := filepath.Join(t.TempDir(), "root")
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(root, "home/user"), 0o755))
	must(os.Chown(filepath.Join(root, "home/user"), 1000, 1000))
	must(os.MkdirAll(filepath.Join(root, "usr/bin"), 0o755))
	must(os.WriteFile(filepath.Join(root, "usr/bin/tool"), []byte("tool"), 0o755))
	must(unix.Chmod(filepath.Join(root, "usr/bin/tool"), 0o4755))
	must(os.Link(filepath.Join(root, "usr/bin/tool"), filepath.Join(root, "usr/bin/tool2")))
	must(os.Symlink("tool", filepath.Join(root, "usr/bin/alias")))
	must(unix.Mkfifo(filepath.Join(root, "fifo"), 0o600))
	must(os.MkdirAll(filepath.Join(root, "dev"), 0o755))
	must(unix.Mknod(filepath.Join(root, "dev/null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	must(unix.Mknod(filepath.Join(root, "devnode"), unix.S_IFCHR|0o600, int(unix.Mkdev(1, 5))))
	xattrOK := unix.Lsetxattr(filepath.Join(root, "usr/bin/tool"), "user.cube", []byte("v"), 0) == nil

	out := filepath.Join(t.TempDir(), "layer.tar")
	digest, size, err := packDir(root, out, []string{"dev"})
	must(err)
	data, err := os.ReadFile(out)
	must(err)
	sum := sha256.Sum256(data)
	if digest.Hex != hex.EncodeToString(sum[:]) || size != int64(len(data)) {
		t.Fatalf("digest/size %v %d do not match the file", digest, size)
	}
	f, err := os.Open(out)
	must(err)
	defer f.Close()
	got := map[string]*tar.Header{}
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		must(err)
		got[h.Name] = h
	}
	check := func(name string, ok func(h *tar.Header) bool) {
		t.Helper()
		h := got[name]
		if h == nil || !ok(h) {
			t.Errorf("%s: %+v", name, h)
		}
	}
	check("home/user/", func(h *tar.Header) bool {
		return h.Typeflag == tar.TypeDir && h.Uid == 1000 && h.Gid == 1000 && h.Uname == ""
	})
	check("usr/bin/tool", func(h *tar.Header) bool {
		return h.Typeflag == tar.TypeReg && h.Size == 4 && h.Mode&0o7777 == 0o4755 && (!xattrOK || h.PAXRecords["SCHILY.xattr.user.cube"] == "v")
	})
	check("usr/bin/tool2", func(h *tar.Header) bool { return h.Typeflag == tar.TypeLink && h.Linkname == "usr/bin/tool" })
	check("usr/bin/alias", func(h *tar.Header) bool { return h.Typeflag == tar.TypeSymlink && h.Linkname == "tool" })
	check("fifo", func(h *tar.Header) bool { return h.Typeflag == tar.TypeFifo })
	check("devnode", func(h *tar.Header) bool { return h.Typeflag == tar.TypeChar && h.Devmajor == 1 && h.Devminor == 5 })
	check("dev/", func(h *tar.Header) bool { return h.Typeflag == tar.TypeDir })
	if got["dev/null"] != nil {
		t.Errorf("skipped dev/null was packed")
	}
}
