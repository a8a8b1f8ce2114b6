package identity

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/testenv"
)

func testDB(t *testing.T) DB {
	t.Helper()
	dir := t.TempDir()
	passwd := "root:x:0:0:root:/root:/bin/sh\n# comment\nbroken line\nuser:x:1000:1000:user:/home/user:/bin/sh\nnohome:x:1001:1001::rel:/bin/sh\n"
	group := "root:x:0:\nuser:x:1000:\nwheel:x:10:user,other\ndocker:x:999:other\n"
	db := DB{Passwd: filepath.Join(dir, "passwd"), Group: filepath.Join(dir, "group")}
	if err := os.WriteFile(db.Passwd, []byte(passwd), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(db.Group, []byte(group), 0o644); err != nil {
		t.Fatal(err)
	}
	return db
}

func TestLookup(t *testing.T) {
	db := testDB(t)
	u, err := db.Lookup("user")
	if err != nil {
		t.Fatal(err)
	}
	if u.UID != 1000 || u.GID != 1000 || u.Home != "/home/user" || len(u.Groups) != 1 || u.Groups[0] != 10 {
		t.Fatalf("user = %+v", u)
	}
	if u, _ := db.Lookup("nohome"); u.Home != "/" {
		t.Errorf("relative home not replaced: %q", u.Home)
	}
	if _, err := db.Lookup("ghost"); !errdefs.IsNotFound(err) {
		t.Errorf("unknown user: %v", err)
	}
	for _, bad := range []string{"", "a:b", "../x"} {
		if _, err := db.Lookup(bad); !errdefs.IsInvalidArgument(err) {
			t.Errorf("Lookup(%q) = %v, want InvalidArgument", bad, err)
		}
	}
	if _, err := (DB{Passwd: "/nonexistent"}).Lookup("root"); !errdefs.IsNotFound(err) {
		t.Errorf("missing passwd: %v", err)
	}
	n := db.Names()
	if n.User(1000) != "user" || n.Group(10) != "wheel" || n.User(4242) != "4242" {
		t.Errorf("names: %q %q %q", n.User(1000), n.Group(10), n.User(4242))
	}
}

func TestResolve(t *testing.T) {
	u := &User{Name: "user", Home: "/home/user"}
	cases := []struct{ in, workdir, want string }{
		{"", "", "/home/user"},
		{"", "/srv", "/srv"},
		{"~", "", "/home/user"},
		{"~/a/../b", "", "/home/user/b"},
		{"file.txt", "/srv", "/home/user/file.txt"},
		{"/etc//passwd", "", "/etc/passwd"},
		{"../../etc", "", "/etc"},
	}
	for _, c := range cases {
		got, err := u.Resolve(c.in, c.workdir)
		if err != nil || got != c.want {
			t.Errorf("Resolve(%q, %q) = %q, %v; want %q", c.in, c.workdir, got, err, c.want)
		}
	}
	for _, bad := range []string{"~root/x", "a\x00b"} {
		if _, err := u.Resolve(bad, ""); !errdefs.IsInvalidArgument(err) {
			t.Errorf("Resolve(%q) = %v, want InvalidArgument", bad, err)
		}
	}
}

// fsuids returns the fsuid of every thread of this process.
func fsuids(t *testing.T) []string {
	t.Helper()
	tasks, _ := filepath.Glob("/proc/self/task/*/status")
	var out []string
	for _, p := range tasks {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			if f := strings.Fields(line); len(f) == 5 && f[0] == "Uid:" {
				out = append(out, f[4])
			}
		}
	}
	return out
}

func TestAsUser(t *testing.T) {
	testenv.RequireRoot(t, "switches filesystem credentials")
	// Not t.TempDir: its parent is 0700, which the user could not cross.
	dir, err := os.MkdirTemp("", "asuser-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	private := filepath.Join(dir, "private")
	if err := os.Mkdir(private, 0o700); err != nil {
		t.Fatal(err)
	}
	u := &User{Name: "user", UID: 1000, GID: 1000, Home: dir}

	// Many at once: each must see its own identity, and the root
	// goroutines running meanwhile must keep theirs.
	var wg sync.WaitGroup
	for i := range 16 {
		wg.Go(func() {
			name := filepath.Join(dir, "f"+string(rune('a'+i)))
			err := AsUser(u, func() error {
				if _, err := os.ReadDir(private); !errors.Is(err, os.ErrPermission) {
					t.Errorf("user read 0700 root dir: %v", err)
				}
				return os.WriteFile(name, []byte("x"), 0o644)
			})
			if err != nil {
				t.Error(err)
				return
			}
			var st syscall.Stat_t
			if err := syscall.Stat(name, &st); err != nil || st.Uid != 1000 || st.Gid != 1000 {
				t.Errorf("%s owned by %d:%d (%v), want 1000:1000", name, st.Uid, st.Gid, err)
			}
			if _, err := os.ReadDir(private); err != nil {
				t.Errorf("root lost access after AsUser: %v", err)
			}
		})
	}
	wg.Wait()
	for _, id := range fsuids(t) {
		if id != "0" {
			t.Fatalf("a thread kept fsuid %s: %v", id, fsuids(t))
		}
	}
	root := &User{Name: "root"}
	if err := AsUser(root, func() error { return os.WriteFile(filepath.Join(private, "ok"), nil, 0o600) }); err != nil {
		t.Fatalf("root: %v", err)
	}
	if err := AsUser(nil, func() error { return nil }); !errors.Is(err, errdefs.ErrUnauthenticated) {
		t.Fatalf("nil user: %v", err)
	}
}
