package userns

import (
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/testenv"
)

// TestMountIDMapped: through the view, a file owned by 0 on disk shows
// as the range's base and one owned by 1000 as base+1000, and a file
// created through it as the base lands on disk as 0. No namespace holder
// is left running.
func TestMountIDMapped(t *testing.T) {
	testenv.RequireRoot(t, "idmapped mounts need CAP_SYS_ADMIN")
	// Under a directory the range's root may pass (t.TempDir's is 0700).
	top, err := os.MkdirTemp("", "cube-userns-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(top) })
	if err := os.Chmod(top, 0o711); err != nil {
		t.Fatal(err)
	}
	src, dst := filepath.Join(top, "src"), filepath.Join(top, "dst")
	for _, d := range []string{src, dst} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	for name, owner := range map[string]int{"root-file": 0, "user-file": 1000} {
		p := filepath.Join(src, name)
		if err := os.WriteFile(p, nil, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(p, owner, owner); err != nil {
			t.Fatal(err)
		}
	}
	r := Range{HostID: DefaultFirst, Size: Size}
	ns, err := NewNamespace(r, map[string]int{"max_user_namespaces": 0})
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	if _, err := NewNamespace(r, map[string]int{"../../fs/x": 1}); !errdefs.IsInvalidArgument(err) {
		t.Errorf("limit with a path: %v, want invalid argument", err)
	}
	// A limit the kernel refuses fails the namespace, helper reaped.
	if _, err := NewNamespace(r, map[string]int{"max_user_namespaces": -5}); err == nil {
		t.Error("a negative limit was accepted")
	} else {
		t.Logf("negative limit: %v", err)
	}
	if n := helperChildren(t); n != 0 {
		t.Errorf("%d namespace helpers left running after a failure", n)
	}
	if n := helperChildren(t); n != 0 {
		t.Errorf("%d namespace helpers left running", n)
	}
	if owner, err := ns.OwnerUID(); err != nil || owner != r.HostID {
		t.Errorf("namespace owner %d (%v), want the range's base %d", owner, err, r.HostID)
	}
	if err := MountIDMapped(src, dst, ns); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = Unmount(dst) })
	for name, want := range map[string]uint32{"root-file": r.HostID, "user-file": r.HostID + 1000} {
		var st unix.Stat_t
		if err := unix.Stat(filepath.Join(dst, name), &st); err != nil {
			t.Fatal(err)
		}
		if st.Uid != want || st.Gid != want {
			t.Errorf("%s through the view: %d:%d, want %d", name, st.Uid, st.Gid, want)
		}
	}
	// A file created through the view by the range's root is stored as 0.
	if err := createAs(filepath.Join(dst, "made"), int(r.HostID)); err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(src, "made"), &st); err != nil {
		t.Fatal(err)
	}
	if st.Uid != 0 || st.Gid != 0 {
		t.Errorf("file owned by the range's root through the view is %d:%d on disk, want 0:0", st.Uid, st.Gid)
	}
	if err := Unmount(dst); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dst); !os.IsNotExist(err) {
		t.Errorf("Unmount left %s: %v", dst, err)
	}
}

// createAs creates path with fsuid and fsgid id, on a thread of its own
// (the fs IDs are per thread) that is thrown away afterwards.
func createAs(path string, id int) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread exits with the goroutine
		_ = unix.Setfsgid(id)  // returns the previous fsgid, never an error
		_ = unix.Setfsuid(id)
		f, err := os.Create(path)
		if err == nil {
			err = f.Close()
		}
		errc <- err
	}()
	return <-errc
}

// helperChildren counts this process's children running unshare or sh
// (the namespace helper before and after it unshares).
func helperChildren(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	me := strconv.Itoa(os.Getpid())
	n := 0
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...
		s := string(b)
		i := strings.LastIndexByte(s, ')')
		if i < 0 || !strings.HasSuffix(s[:i], "(sh") && !strings.HasSuffix(s[:i], "(unshare") {
			continue
		}
		if f := strings.Fields(s[i+1:]); len(f) > 1 && f[1] == me {
			n++
		}
	}
	return n
}

// BenchmarkNamespaceAndView is what each runc Start spends on its user
// namespace and rootfs view, and Stop on removing the view.
func BenchmarkNamespaceAndView(b *testing.B) {
	testenv.RequireRoot(b, "idmapped mounts need CAP_SYS_ADMIN")
	top := b.TempDir()
	src, dst := filepath.Join(top, "src"), filepath.Join(top, "dst")
	if err := os.Mkdir(src, 0o755); err != nil {
		b.Fatal(err)
	}
	r := Range{HostID: DefaultFirst, Size: Size}
	for b.Loop() {
		if err := os.Mkdir(dst, 0o700); err != nil {
			b.Fatal(err)
		}
		ns, err := NewNamespace(r, map[string]int{"max_user_namespaces": 0, "max_inotify_instances": 128})
		if err != nil {
			b.Fatal(err)
		}
		if err := MountIDMapped(src, dst, ns); err != nil {
			b.Fatal(err)
		}
		ns.Close()
		if err := Unmount(dst); err != nil {
			b.Fatal(err)
		}
	}
}
