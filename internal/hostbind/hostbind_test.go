package hostbind

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/testenv"
)

// world is a test's host: an allowed root holding a source directory with
// a marker file and a writable tmpfs submounted at sub, and a staging
// directory.
type world struct {
	root, src, sub, stage string
}

func newWorld(t *testing.T) world {
	t.Helper()
	testenv.RequireRoot(t, "mounts")
	dir := t.TempDir()
	w := world{root: filepath.Join(dir, "allowed"), stage: filepath.Join(dir, "stage")}
	w.src = filepath.Join(w.root, "src")
	w.sub = filepath.Join(w.src, "sub")
	for _, d := range []string{w.sub, w.stage} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(w.src, "marker"), []byte("original"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", w.sub, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(w.sub, unix.MNT_DETACH) })
	// A device node on the submount: usable through a bind without nodev.
	if err := unix.Mknod(filepath.Join(w.sub, "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := Unstage(w.stage); err != nil {
			t.Errorf("Unstage: %v", err)
		}
	})
	return w
}

// allowUnder is the Check of a single allow prefix.
func allowUnder(root string) func(string) error {
	return func(p string) error {
		if p == root || strings.HasPrefix(p, root+"/") {
			return nil
		}
		return errors.New("not under " + root)
	}
}

func (w world) request(target string, ro bool) Request {
	return Request{Root: w.root, Source: w.src, Target: filepath.Join(w.stage, target), ReadOnly: ro, Check: allowUnder(w.root)}
}

// probe writes at the top of a bind and in its submount and opens the
// submount's device node.
func probe(dir string) (top, sub, dev error) {
	top = os.WriteFile(filepath.Join(dir, "w"), nil, 0o644)
	sub = os.WriteFile(filepath.Join(dir, "sub", "w"), nil, 0o644)
	f, dev := os.OpenFile(filepath.Join(dir, "sub", "null"), os.O_WRONLY, 0)
	if dev == nil {
		_ = f.Close()
	}
	return top, sub, dev
}

// TestStageReadOnlyRecursive: a read-only staged bind is read-only in its
// submount too, and nodev there as well. Control: a bind made the way a
// runtime makes an `ro` bind by name (rbind, then a remount of the top
// mount only) leaves the submount writable and its device node usable.
func TestStageReadOnlyRecursive(t *testing.T) {
	w := newWorld(t)
	r := w.request("ro", true)
	if err := Stage(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	top, sub, dev := probe(r.Target)
	t.Logf("staged ro bind: write top: %v; write submount: %v; open device in submount: %v", top, sub, dev)
	if !errors.Is(top, unix.EROFS) || !errors.Is(sub, unix.EROFS) {
		t.Errorf("staged ro bind writable: top %v, submount %v; want EROFS (MOUNT_ATTR_RDONLY, AT_RECURSIVE)", top, sub)
	}
	if !errors.Is(dev, unix.EACCES) {
		t.Errorf("device in the staged submount opened: %v; want EACCES (MOUNT_ATTR_NODEV, AT_RECURSIVE)", dev)
	}
	for _, p := range []string{r.Target, filepath.Join(r.Target, "sub")} {
		var st unix.Statfs_t
		if err := unix.Statfs(p, &st); err != nil {
			t.Fatal(err)
		}
		if want := uint64(unix.ST_RDONLY | unix.ST_NOSUID | unix.ST_NODEV); uint64(st.Flags)&want != want {
			t.Errorf("%s: flags %#x, want ro,nosuid,nodev", p, st.Flags)
		}
	}

	ctl := filepath.Join(w.stage, "control")
	if err := os.Mkdir(ctl, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(w.src, ctl, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("", ctl, "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY, ""); err != nil {
		t.Fatal(err)
	}
	top, sub, dev = probe(ctl)
	t.Logf("control, rbind + ro remount of the top: write top: %v; write submount: %v; open device: %v", top, sub, dev)
	if !errors.Is(top, unix.EROFS) || sub != nil || dev != nil {
		t.Errorf("control: top %v, submount %v, device %v; want EROFS, writable, open", top, sub, dev)
	}
}

// TestStageReadWrite: a read-write staged bind writes through to the
// source, a file is staged on a file, and both are nosuid,nodev.
func TestStageReadWrite(t *testing.T) {
	w := newWorld(t)
	r := w.request("rw", false)
	if err := Stage(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(r.Target, "sub", "out"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(w.sub, "out")); err != nil || string(b) != "x" {
		t.Fatalf("write through the staged submount: %q %v", b, err)
	}
	if _, _, dev := probe(r.Target); !errors.Is(dev, unix.EACCES) {
		t.Errorf("device through a rw staged bind: %v; want EACCES", dev)
	}
	f := Request{Root: w.root, Source: filepath.Join(w.src, "marker"), Target: filepath.Join(w.stage, "file"), ReadOnly: true, Check: allowUnder(w.root)}
	if err := Stage(context.Background(), f); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(f.Target); err != nil || string(b) != "original" {
		t.Fatalf("staged file: %q %v", b, err)
	}
	if err := os.WriteFile(f.Target, nil, 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("write to a ro staged file: %v", err)
	}
}

// TestStageRefusals: what Stage refuses, each with FailedPrecondition and
// nothing left at the staging path.
func TestStageRefusals(t *testing.T) {
	w := newWorld(t)
	outside := filepath.Join(filepath.Dir(w.root), "outside")
	if err := os.Mkdir(outside, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(w.root, "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(filepath.Join(w.src, "marker"), filepath.Join(w.root, "hardlink")); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mkfifo(filepath.Join(w.root, "fifo"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name, source, root string
		check              func(string) error
		msg                string
	}{
		{"symlink source", filepath.Join(w.root, "link"), w.root, nil, "symlink"},
		{"symlink in a parent", filepath.Join(w.root, "link", "x"), w.root, nil, "symlink"},
		{"hard-linked file", filepath.Join(w.root, "hardlink"), w.root, nil, "hard links"},
		{"fifo", filepath.Join(w.root, "fifo"), w.root, nil, "neither"},
		{"missing", filepath.Join(w.root, "nope"), w.root, nil, "no such file"},
		{"not beneath root", outside, w.root, nil, "not beneath"},
		{"check refuses", w.src, w.root, func(string) error { return errors.New("no rule") }, "no rule"},
	} {
		check := c.check
		if check == nil {
			check = allowUnder(w.root)
		}
		target := filepath.Join(w.stage, "t")
		err := Stage(context.Background(), Request{Root: c.root, Source: c.source, Target: target, Check: check})
		if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), c.msg) {
			t.Errorf("%s: %v; want FailedPrecondition mentioning %q", c.name, err, c.msg)
		} else {
			t.Logf("%s: refused: %v", c.name, err)
		}
		if _, err := os.Lstat(target); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s: staging path left: %v", c.name, err)
		}
	}
}

// TestUnstage: every staging mount and path goes, and the directory.
func TestUnstage(t *testing.T) {
	w := newWorld(t)
	for _, name := range []string{"a", "b"} {
		if err := Stage(context.Background(), w.request(name, name == "a")); err != nil {
			t.Fatal(err)
		}
	}
	if err := Unstage(w.stage); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(w.stage); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("staging dir left: %v", err)
	}
	ms, err := mountinfo.GetMounts(mountinfo.PrefixFilter(w.stage))
	if err != nil || len(ms) != 0 {
		t.Errorf("mounts left under %s: %v %v", w.stage, ms, err)
	}
	if b, err := os.ReadFile(filepath.Join(w.src, "marker")); err != nil || string(b) != "original" {
		t.Errorf("source touched: %q %v", b, err)
	}
	if err := Unstage(w.stage); err != nil {
		t.Errorf("second Unstage: %v", err)
	}
}

// BenchmarkStage is the cost a host mount adds to a start: stage (open,
// check, clone, attach) and unstage.
//
//	go test -run '^$' -bench Stage ./internal/hostbind/
func BenchmarkStage(b *testing.B) {
	testenv.RequireRoot(b, "mounts")
	dir := b.TempDir()
	root, stage := filepath.Join(dir, "allowed"), filepath.Join(dir, "stage")
	src := filepath.Join(root, "src")
	for _, d := range []string{src, stage} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			b.Fatal(err)
		}
	}
	r := Request{Root: root, Source: src, Target: filepath.Join(stage, "0"), ReadOnly: true, Check: allowUnder(root)}
	for b.Loop() {
		if err := Stage(context.Background(), r); err != nil {
			b.Fatal(err)
		}
		if err := unstageOne(r.Target); err != nil {
			b.Fatal(err)
		}
	}
}
