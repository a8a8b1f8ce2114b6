package cgroups

import (
	"crypto/rand"
	"encoding/hex"
	"github.com/cubesandbox/cube/internal/testenv"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"
)

func TestUnescapeMountinfo(t *testing.T) {
	for in, want := range map[string]string{
		"/sys/fs/cgroup/memory":      "/sys/fs/cgroup/memory",
		`/mnt/a\040b`:                "/mnt/a b",
		`/mnt/tab\011nl\012`:         "/mnt/tab\tnl\n",
		`/mnt/back\134slash`:         `/mnt/back\slash`,
		`/mnt/not\08octal`:           `/mnt/not\08octal`,
		`/mnt/short\04`:              `/mnt/short\04`,
		`/mnt/trailing\`:             `/mnt/trailing\`,
		`\040\040`:                   "  ",
		"/sys/fs/cgroup/cpu,cpuacct": "/sys/fs/cgroup/cpu,cpuacct",
	} {
		if got := unescapeMountinfo(in); got != want {
			t.Errorf("unescapeMountinfo(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestMounts(t *testing.T) {
	mounts, err := Mounts()
	if err != nil {
		t.Fatal(err)
	}
	if len(mounts) == 0 {
		testenv.Missing(t, "no cgroup hierarchy mounted")
	}
	for _, m := range mounts {
		if fi, err := os.Stat(m); err != nil || !fi.IsDir() {
			t.Errorf("mount %s: %v, want a directory", m, err)
		}
	}
}

// TestDirsRemove creates a cgroup in every hierarchy and checks that Dirs
// finds it there, Remove takes it out of all of them and a second Remove
// is a no-op.
func TestDirsRemove(t *testing.T) {
	testenv.RequireRoot(t, "creates cgroups")
	mounts, err := Mounts()
	if err != nil {
		t.Fatal(err)
	}
	if len(mounts) == 0 {
		testenv.Missing(t, "no cgroup hierarchy mounted")
	}
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	path := "/cube-cgtest-" + hex.EncodeToString(b)
	var made []string
	for _, m := range mounts {
		d := filepath.Join(m, path)
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Logf("skip hierarchy %s: %v", m, err)
			continue
		}
		made = append(made, d)
	}
	t.Cleanup(func() {
		for _, d := range made {
			_ = os.Remove(d)
		}
	})
	if len(made) == 0 {
		testenv.Missing(t, "no writable cgroup hierarchy")
	}

	dirs, err := Dirs(path)
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(dirs)
	slices.Sort(made)
	if !slices.Equal(dirs, made) {
		t.Fatalf("Dirs(%s) = %v, want %v", path, dirs, made)
	}
	found, err := Remove(path, time.Second)
	if err != nil {
		t.Fatalf("Remove(%s): %v", path, err)
	}
	slices.Sort(found)
	if !slices.Equal(found, made) {
		t.Errorf("Remove(%s) found %v, want %v", path, found, made)
	}
	for _, d := range made {
		if _, err := os.Stat(d); !os.IsNotExist(err) {
			t.Errorf("%s after Remove: %v", d, err)
		}
	}
	if found, err := Remove(path, time.Second); err != nil || len(found) != 0 {
		t.Errorf("second Remove(%s) = %v, %v; want nothing found, nil", path, found, err)
	}
	if dirs, err := Dirs("/"); err != nil || len(dirs) != 0 {
		t.Errorf("Dirs(/) = %v, %v; want no hierarchy root listed", dirs, err)
	}
}
