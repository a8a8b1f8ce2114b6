package cgroups

import (
	"crypto/rand"
	"encoding/hex"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/testenv"
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

// TestParseMounts: the hierarchies of a hybrid host's mountinfo, which
// of them hold the memory controller (a v1 mount with "memory" among its
// options, co-mounted or not; cgroup2 always, its files say whether it has
// it), an empty source, and the mounts that are not cgroups.
func TestParseMounts(t *testing.T) {
	const mountinfo = `22 1 0:21 / /sys rw,nosuid - sysfs sysfs rw
25 22 0:23 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
26 25 0:24 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
27 25 0:25 /docker/c1 /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
28 25 0:26 / /sys/fs/cgroup/pids rw,relatime - cgroup  rw,pids
29 25 0:27 / /sys/fs/cgroup/blkio,memory rw,relatime - cgroup  rw,blkio,memory
30 25 0:28 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
31 25 0:29 / /sys/fs/cgroup/a\040b rw,relatime - cgroup cgroup rw,name=systemd
`
	got, err := parseMounts(strings.NewReader(mountinfo))
	if err != nil {
		t.Fatal(err)
	}
	want := []hierarchy{
		{path: "/sys/fs/cgroup/cpu,cpuacct", opts: "rw,cpu,cpuacct", root: "/"},
		{path: "/sys/fs/cgroup/memory", memory: true, opts: "rw,memory", root: "/docker/c1"},
		{path: "/sys/fs/cgroup/pids", opts: "rw,pids", root: "/"},
		{path: "/sys/fs/cgroup/blkio,memory", memory: true, opts: "rw,blkio,memory", root: "/"},
		{path: "/sys/fs/cgroup/unified", v2: true, memory: true},
		{path: "/sys/fs/cgroup/a b", opts: "rw,name=systemd", root: "/"},
	}
	if !slices.Equal(got, want) {
		t.Fatalf("parseMounts:\n got %+v\nwant %+v", got, want)
	}
	// A hierarchy as /proc/<pid>/cgroup names it: all its controllers
	// among a v1 mount's options; cgroup2 is never one.
	for ctrls, mp := range map[string]V1Mount{
		"cpu,cpuacct": {"/sys/fs/cgroup/cpu,cpuacct", "/"}, "memory": {"/sys/fs/cgroup/memory", "/docker/c1"},
		"blkio,memory": {"/sys/fs/cgroup/blkio,memory", "/"}, "name=systemd": {"/sys/fs/cgroup/a b", "/"},
		"net_cls": {}, "cpu,memory": {},
	} {
		if got, ok := v1MountIn(want, ctrls); got != mp || ok != (mp.Path != "") {
			t.Errorf("v1MountIn(%q) = %+v, %v; want %+v", ctrls, got, ok, mp)
		}
	}
}
