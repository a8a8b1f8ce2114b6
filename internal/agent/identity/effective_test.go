package identity

import (
	"os"
	"path/filepath"
	"runtime"
	"syscall"
	"testing"

	"github.com/cubesandbox/cube/internal/testenv"
	"golang.org/x/sys/unix"
)

// TestSwitchThreadEffective drives the fallback AsUser takes where the
// kernel has no setfsuid (gVisor): files made by the switched thread
// belong to the user, a root-only file is refused, and the thread is root
// again afterwards with its groups back.
func TestSwitchThreadEffective(t *testing.T) {
	testenv.RequireRoot(t, "the test acts as root")
	// Not t.TempDir(): its parent is 0700, which nobody cannot cross.
	dir, err := os.MkdirTemp("", "cube-identity-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	secret := filepath.Join(dir, "secret")
	if err := os.WriteFile(secret, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	u := &User{Name: "nobody", UID: 65534, GID: 65534}
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		groups, _ := unix.Getgroups()
		restore, err := switchThreadEffective(u, func() error { return unix.Setgroups(groups) })
		if err != nil {
			done <- err
			return
		}
		ferr := os.WriteFile(filepath.Join(dir, "mine"), []byte("y"), 0o644)
		_, serr := os.ReadFile(secret)
		if err := restore(); err != nil {
			done <- err // stays locked: the runtime drops the thread
			return
		}
		if unix.Geteuid() != 0 || unix.Getegid() != 0 {
			done <- os.ErrPermission
			return
		}
		runtime.UnlockOSThread()
		if ferr != nil {
			done <- ferr
			return
		}
		if serr == nil {
			done <- os.ErrExist // read a root-only file as nobody
			return
		}
		done <- nil
	}()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(filepath.Join(dir, "mine"))
	if err != nil {
		t.Fatal(err)
	}
	if s := st.Sys().(*syscall.Stat_t); s.Uid != u.UID || s.Gid != u.GID {
		t.Fatalf("file made as %s belongs to %d:%d", u.Name, s.Uid, s.Gid)
	}
	if os.Geteuid() != 0 {
		t.Fatal("the process lost root")
	}
}
