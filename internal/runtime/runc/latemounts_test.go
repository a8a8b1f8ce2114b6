package runc

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/ocispec"
)

// /dev/shm and the masked directories under /proc (/proc/acpi where the
// host has it) are made by the driver after runc has run, as mounts of
// no new superblock: /dev/shm a directory of the sandbox's /dev tmpfs
// bound onto itself nosuid,nodev,noexec, /proc/acpi a read-only bind of
// the driver's empty directory. What a sandbox sees of them is what
// runc's tmpfs gave: a world-writable sticky /dev/shm where nothing
// executes, an empty /proc/acpi nothing can write. The control starts
// the same spec through runc alone: there both are tmpfs mounts of their
// own, and the same binary that /dev/shm refuses to execute runs from
// /dev, which is not noexec. On a host with cgroup v1 hierarchies the
// same goes for /sys/fs/cgroup: a read-only bind of the host's tmpfs
// with the sandbox's own cgroups bound at its mount points, where runc
// makes a tmpfs of its own; the sandbox reads its memory limit there in
// both.
func TestLateMountsMakeNoSuperblock(t *testing.T) {
	requireRoot(t)
	d := newTestDriver(t)
	parent := cgroupParent(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	s := sleepSpec(t, parent, "late-mounts")
	t.Cleanup(func() { _ = d.Stop(context.Background(), s.ID) })
	st, err := d.Start(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	_, hostDevs := mountsOf(t, os.Getpid())
	mnts, devs := mountsOf(t, st.PID)
	dev, shm := mnts["/dev"], mnts["/dev/shm"]
	if shm.dev != dev.dev || shm.root != "/shm" {
		t.Fatalf("/dev/shm is %+v, want the directory shm of /dev's tmpfs (%s)", shm, dev.dev)
	}
	for _, o := range []string{"nosuid", "nodev", "noexec", "rw"} {
		if !slices.Contains(strings.Split(shm.opts, ","), o) {
			t.Errorf("/dev/shm is mounted %q, want %s", shm.opts, o)
		}
	}
	if out := strings.TrimSpace(execIn(t, d, s.BundleDir, s.ID, 0, "/bin/busybox", "stat", "-c", "%A %u %g", "/dev/shm")); out != "drwxrwxrwt 0 0" {
		t.Errorf("/dev/shm in the sandbox: %q, want drwxrwxrwt owned by its root (0 0)", out)
	}
	if out := execIn(t, d, s.BundleDir, s.ID, 1000, "/bin/sh", "-c", "echo hi > /dev/shm/u && cat /dev/shm/u"); !strings.Contains(out, "hi") {
		t.Errorf("a user writing /dev/shm: %q, want it written", out)
	}
	const probe = "/bin/busybox cp /bin/busybox %[1]s/true && %[1]s/true; echo rc=$?"
	if out := execIn(t, d, s.BundleDir, s.ID, 0, "/bin/sh", "-c", fmt.Sprintf(probe, "/dev/shm")); !strings.Contains(out, "rc=126") {
		t.Errorf("executing a file in /dev/shm: %q, want it refused (126)", out)
	}
	if out := execIn(t, d, s.BundleDir, s.ID, 0, "/bin/sh", "-c", fmt.Sprintf(probe, "/dev")); !strings.Contains(out, "rc=0") {
		t.Errorf("control: executing the same file in /dev: %q, want it run", out)
	}

	acpi := isDir("/proc/acpi")
	if acpi {
		m := mnts["/proc/acpi"]
		if !strings.HasSuffix(m.root, "/masked") || !hostDevs[m.dev] || !slices.Contains(strings.Split(m.opts, ","), "ro") {
			t.Errorf("/proc/acpi is %+v, want a read-only bind of the driver's empty directory", m)
		}
		if out := execIn(t, d, s.BundleDir, s.ID, 0, "/bin/sh", "-c", "ls -A /proc/acpi; mkdir /proc/acpi/x 2>&1; echo rc=$?"); !strings.HasPrefix(strings.TrimSpace(out), "mkdir") || !strings.Contains(out, "rc=1") {
			t.Errorf("/proc/acpi in the sandbox: %q, want it empty and read-only", out)
		}
	} else {
		t.Log("the host has no /proc/acpi: nothing to mask there")
	}
	v1 := cgroupV1Tree()
	if v1 {
		cg := mnts["/sys/fs/cgroup"]
		if !hostDevs[cg.dev] || cg.fstype != "tmpfs" || !slices.Contains(strings.Split(cg.opts, ","), "ro") {
			t.Errorf("/sys/fs/cgroup is %+v, want a read-only bind of the host's tmpfs", cg)
		}
		mem := mnts["/sys/fs/cgroup/memory"]
		if mem.fstype != "cgroup" || !strings.HasSuffix(mem.root, s.CgroupPath) || !slices.Contains(strings.Split(mem.opts, ","), "ro") {
			t.Errorf("/sys/fs/cgroup/memory is %+v, want a read-only bind of the sandbox's cgroup %s", mem, s.CgroupPath)
		}
		// The sandbox's own limit (sleepSpec: 32 MiB), not writable.
		out := execIn(t, d, s.BundleDir, s.ID, 0, "/bin/sh", "-c", "cat /sys/fs/cgroup/memory/memory.limit_in_bytes; echo 1 > /sys/fs/cgroup/memory/memory.limit_in_bytes; echo rc=$?")
		if !strings.Contains(out, "33554432\n") || !strings.Contains(out, "rc=1") {
			t.Errorf("the sandbox's memory cgroup from inside: %q, want its 32 MiB limit, read-only", out)
		}
	}
	own := notIn(devs, hostDevs)

	// Control: runc's own /dev/shm and masking.
	c := sleepSpec(t, parent, "late-mounts-runc")
	startWith(ctx, t, d, c, nil)
	cst, err := d.rc.State(ctx, c.ID)
	if err != nil {
		t.Fatal(err)
	}
	cm, cdevs := mountsOf(t, cst.Pid)
	if m := cm["/dev/shm"]; m.fstype != "tmpfs" || m.dev == cm["/dev"].dev {
		t.Fatalf("control: runc's /dev/shm is %+v, want a tmpfs of its own", m)
	}
	cown := notIn(cdevs, hostDevs)
	if v1 {
		out := execIn(t, d, c.BundleDir, c.ID, 0, "/bin/cat", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
		if strings.TrimSpace(out) != "33554432" {
			t.Errorf("control: the memory limit under runc's /sys/fs/cgroup: %q", out)
		}
		// Every hierarchy runc shows is there.
		ours := strings.Fields(execIn(t, d, s.BundleDir, s.ID, 0, "/bin/ls", "/sys/fs/cgroup"))
		for _, e := range strings.Fields(execIn(t, d, c.BundleDir, c.ID, 0, "/bin/ls", "/sys/fs/cgroup")) {
			if !slices.Contains(ours, e) {
				t.Errorf("/sys/fs/cgroup lacks %s, which runc's has (ours: %v)", e, ours)
			}
		}
	}
	// runc alone has a tmpfs more for /dev/shm, for the cgroup v1 tree,
	// and for each masked directory (those under /sys are binds in the
	// driver's spec: TestMaskedSysDirsAreBinds).
	want := cown - 1
	if v1 {
		want--
	}
	spec, err := ocispec.For(c)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range spec.Linux.MaskedPaths {
		if isDir(p) {
			want--
		}
	}
	if own != want {
		t.Errorf("the sandbox has %d superblocks of its own, runc alone %d: want %d", own, cown, want)
	}
	t.Logf("superblocks of its own: %d through the driver, %d through runc alone", own, cown)
}

// A failure after runc has run and before the late mounts are made
// leaves nothing: no container, no cgroup, no user namespace directory.
func TestLateMountsFailureRollsBack(t *testing.T) {
	requireRoot(t)
	d := newTestDriver(t)
	parent := cgroupParent(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := failpoint.Enable(FailpointLateMounts, "error(injected)"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { failpoint.Disable(FailpointLateMounts) })

	s := sleepSpec(t, parent, "late-fail")
	t.Cleanup(func() { _ = d.Stop(context.Background(), s.ID) })
	_, err := d.Start(ctx, s)
	if !errors.Is(err, failpoint.ErrInjected) || !errdefs.IsInternal(err) {
		t.Fatalf("Start = %v, want the injected failure as internal", err)
	}
	if _, err := os.Stat(filepath.Join(d.rc.Root, s.ID)); !os.IsNotExist(err) {
		t.Errorf("runc state after the failed start: %v, want none", err)
	}
	if _, err := os.Stat(d.uns.dir(s.ID)); !os.IsNotExist(err) {
		t.Errorf("sandbox directory after the failed start: %v, want it removed", err)
	}
	assertNoChildCgroups(t, parent)

	failpoint.Disable(FailpointLateMounts)
	if _, err := d.Start(ctx, s); err != nil {
		t.Fatalf("Start again without the failure: %v", err)
	}
}

// A volume at or under /dev/shm keeps runc's /dev/shm; without one the
// default tmpfs leaves the spec and /dev/shm is made as the sandbox's
// root.
func TestDeferMountsLeavesVolumes(t *testing.T) {
	spec := func(extra ...runtime.Mount) *specs.Spec {
		sp, err := ocispec.For(runtime.Spec{ID: "x", RootFS: "/r", Args: []string{"/bin/true"}, Mounts: extra})
		if err != nil {
			t.Fatal(err)
		}
		sp.Linux.UIDMappings = []specs.LinuxIDMapping{{ContainerID: 0, HostID: 100000, Size: 65536}}
		return sp
	}
	sp := spec()
	l := deferMounts(sp, "/empty")
	if !l.shm || l.owner != 100000 || slices.ContainsFunc(sp.Mounts, isDefaultShm) {
		t.Errorf("no volume: shm %v owner %d, default tmpfs still in the spec %v; want it made late as 100000",
			l.shm, l.owner, slices.ContainsFunc(sp.Mounts, isDefaultShm))
	}
	for _, dst := range []string{"/dev/shm", "/dev/shm/data"} {
		sp := spec(runtime.Mount{Source: "/host/vol", Destination: dst})
		if l := deferMounts(sp, "/empty"); l.shm || !slices.ContainsFunc(sp.Mounts, isDefaultShm) {
			t.Errorf("volume at %s: shm %v, want runc's /dev/shm kept", dst, l.shm)
		}
	}
	// The cgroup tree: made late where runc would hold the v1
	// hierarchies in a tmpfs of its own, left to runc otherwise (cgroup2
	// is one superblock for every sandbox) and wherever a volume lies in
	// it.
	sp = spec()
	if l := deferMounts(sp, "/empty"); l.cgroupV1 != cgroupV1Tree() || l.cgroupV1 == slices.ContainsFunc(sp.Mounts, isCgroupMount) {
		t.Errorf("no volume: cgroupV1 %v on a host where runc's tree would be a tmpfs: %v; cgroup mount still in the spec: %v",
			l.cgroupV1, cgroupV1Tree(), slices.ContainsFunc(sp.Mounts, isCgroupMount))
	}
	for _, dst := range []string{"/sys/fs/cgroup", "/sys/fs/cgroup/x"} {
		sp = spec(runtime.Mount{Source: "/host/vol", Destination: dst})
		if l := deferMounts(sp, "/empty"); l.cgroupV1 || !slices.ContainsFunc(sp.Mounts, isCgroupMount) {
			t.Errorf("volume at %s: cgroupV1 %v, want runc's cgroup mount kept", dst, l.cgroupV1)
		}
	}
}

// The sandbox's init is known by its cgroup, whole or as the end of a
// path seen from a hierarchy's root; a process elsewhere is not it.
func TestInCgroup(t *testing.T) {
	const sb = "/cube/sb1"
	for procCgroup, want := range map[string]bool{
		"4:memory:/cube/sb1\n0::/cube/sb1\n":     true,
		"0::/cube/sb1\n":                         true,
		"4:memory:/docker/c1/cube/sb1\n":         true,
		"4:memory:/cube/sb10\n0::/cube/sb10\n":   false,
		"4:memory:/x/cube/sb1/child\n":           false,
		"4:memory:/\n0::/user.slice/session-1\n": false,
		"":                                       false,
	} {
		if got := inCgroup(procCgroup, sb); got != want {
			t.Errorf("inCgroup(%q, %s) = %v, want %v", procCgroup, sb, got, want)
		}
	}
}
