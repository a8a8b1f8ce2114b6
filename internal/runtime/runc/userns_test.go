package runc

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/cgroups"
	"github.com/cubesandbox/cube/internal/runtime/userns"
	"github.com/cubesandbox/cube/internal/testenv"
)

// procStatusField returns a field of /proc/<pid>/status ("Uid", ...).
func procStatusField(t *testing.T, pid int, field string) []string {
	t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), field+":"); ok {
			return strings.Fields(v)
		}
	}
	t.Fatalf("no %s in /proc/%d/status", field, pid)
	return nil
}

// runcExec runs a command in a running sandbox with `runc exec` and returns
// its combined output.
func runcExec(t *testing.T, d *Driver, id string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, d.rc.Command, append([]string{"--root", d.rc.Root, "exec", id}, args...)...)
	out, err := cmd.CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

// nsenterIn runs a command in every namespace of the sandbox whose PID 1
// is pid, as its root. `runc exec` cannot enter a sandbox whose network
// namespace belongs to the host's user namespace: runc joins the user
// namespace first and then lacks the right to join the other; util-linux
// nsenter retries such namespaces after it.
func nsenterIn(t *testing.T, pid int, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "nsenter", append([]string{"-t", strconv.Itoa(pid), "-a", "-r", "-w"}, args...)...).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

// hostRootOnly makes a directory holding a 0600 root-owned file, to be
// bound into a sandbox.
func hostRootOnly(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "secret"), []byte("host root only\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return dir
}

func startSleep(t *testing.T, d *Driver, spec runtime.Spec) runtime.State {
	t.Helper()
	t.Cleanup(func() {
		if err := d.Stop(context.Background(), spec.ID); err != nil {
			t.Errorf("stop %s: %v", spec.ID, err)
		}
	})
	st, err := d.Start(context.Background(), spec)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// TestRootIsUnprivilegedOnHost: the sandbox's root is its range's base
// uid on the host, files it creates keep container ownership on disk (0),
// and a host-root-only file bound in is out of its reach. Control: the
// same probes in a sandbox without a user namespace show host uid 0 and
// read the file.
func TestRootIsUnprivilegedOnHost(t *testing.T) {
	requireRoot(t)
	parent := cgroupParent(t)
	secret := hostRootOnly(t)
	for _, tc := range []struct {
		name     string
		u        UserNS
		isolated bool
	}{
		{"userns", UserNS{}, true},
		{"control without userns", UserNS{Disabled: true}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newTestDriverWith(t, tc.u)
			spec := sleepSpec(t, parent, "uid-"+strconv.FormatBool(tc.isolated))
			spec.Mounts = []runtime.Mount{{Source: secret, Destination: "/mnt", ReadOnly: true}}
			st := startSleep(t, d, spec)

			uids := procStatusField(t, st.PID, "Uid")
			wantUID := "0"
			if tc.isolated {
				r, ok, err := d.uns.alloc.Get(spec.ID)
				if err != nil || !ok {
					t.Fatalf("no range for %s: %v", spec.ID, err)
				}
				wantUID = strconv.FormatUint(uint64(r.HostID), 10)
			}
			if uids[0] != wantUID || uids[1] != wantUID {
				t.Fatalf("PID 1 host uids %v, want %s", uids, wantUID)
			}
			t.Logf("PID 1 runs as host uid %s", uids[0])

			if out, err := runcExec(t, d, spec.ID, "/bin/sh", "-c", "echo x > /tmp/made-inside"); err != nil {
				t.Fatalf("create file inside: %v: %s", err, out)
			}
			var fi unix.Stat_t
			if err := unix.Stat(filepath.Join(spec.RootFS, "tmp/made-inside"), &fi); err != nil {
				t.Fatal(err)
			}
			if fi.Uid != 0 || fi.Gid != 0 {
				t.Errorf("file made by the sandbox's root is %d:%d on disk, want 0:0", fi.Uid, fi.Gid)
			}
			t.Logf("file made by the sandbox's root is %d:%d on disk", fi.Uid, fi.Gid)

			out, err := runcExec(t, d, spec.ID, "/bin/cat", "/mnt/secret")
			switch {
			case tc.isolated && err == nil:
				t.Fatalf("sandbox root read a host-root-only file: %q", out)
			case tc.isolated:
				t.Logf("sandbox root cannot read the host-root-only file: %s (stopped by: its root is host uid %s)", out, wantUID)
			case err != nil:
				t.Fatalf("control: root without userns cannot read the file either: %v: %s", err, out)
			default:
				t.Logf("control: root without userns reads it: %q", out)
			}
		})
	}
}

// TestRangesDisjointAndReleased: two sandboxes get disjoint ranges, a
// new Driver on the same root sees them, Stop releases them and so does
// a failed Start.
func TestRangesDisjointAndReleased(t *testing.T) {
	requireRoot(t)
	parent := cgroupParent(t)
	d := newTestDriver(t)
	a := startSleep(t, d, sleepSpec(t, parent, "range-a"))
	b := startSleep(t, d, sleepSpec(t, parent, "range-b"))
	ra, _, _ := d.uns.alloc.Get(a.ID)
	rb, _, _ := d.uns.alloc.Get(b.ID)
	if ra.Size != userns.Size || rb.Size != userns.Size || ra.Contains(rb.HostID) || rb.Contains(ra.HostID) {
		t.Fatalf("ranges overlap or are wrong: %+v %+v", ra, rb)
	}
	for _, st := range []runtime.State{a, b} {
		r, _, _ := d.uns.alloc.Get(st.ID)
		uid, _ := strconv.ParseUint(procStatusField(t, st.PID, "Uid")[0], 10, 32)
		if uid != uint64(r.HostID) {
			t.Errorf("%s runs as host uid %d, its range is %+v", st.ID, uid, r)
		}
	}
	t.Logf("ranges: %s %+v, %s %+v", a.ID, ra, b.ID, rb)

	// A restarted cubelet builds a new Driver on the same root.
	d2, err := New(Config{Root: d.rc.Root, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ids, err := d2.uns.alloc.IDs()
	if err != nil || strings.Join(ids, ",") != "range-a,range-b" {
		t.Fatalf("new driver sees allocations %v, %v", ids, err)
	}
	if err := d2.Stop(context.Background(), a.ID); err != nil {
		t.Fatal(err)
	}
	if _, ok, _ := d.uns.alloc.Get(a.ID); ok {
		t.Error("range of a stopped sandbox still allocated")
	}
	if _, err := os.Stat(d.uns.dir(a.ID)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("mount dir of a stopped sandbox left: %v", err)
	}
	// The freed block is free again (other drivers on the host may hold
	// lower blocks, so look beyond the lowest).
	if free, _ := d.uns.alloc.Free(userns.DefaultCount); !slices.Contains(free, ra) {
		t.Errorf("freed range %+v not among the free ones", ra)
	}
	c := startSleep(t, d, sleepSpec(t, parent, "range-c"))
	if rc, _, _ := d.uns.alloc.Get(c.ID); rc.Contains(rb.HostID) || rb.Contains(rc.HostID) {
		t.Errorf("range-c %+v overlaps range-b %+v", rc, rb)
	}

	bad := sleepSpec(t, parent, "range-bad")
	bad.Args = []string{"/no/such/binary"}
	if _, err := d.Start(context.Background(), bad); err == nil {
		t.Fatal("Start of a missing binary succeeded")
	}
	if _, ok, _ := d.uns.alloc.Get(bad.ID); ok {
		t.Error("range of a failed start still allocated")
	}
	if _, err := os.Stat(d.uns.dir(bad.ID)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("mount dir of a failed start left: %v", err)
	}
	// A failure before runc runs (a bundle that cannot be written).
	bad2 := sleepSpec(t, parent, "range-bad2")
	if err := os.WriteFile(bad2.BundleDir, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Start(context.Background(), bad2); err == nil {
		t.Fatal("Start with a file as bundle dir succeeded")
	}
	if ids, _ := d.uns.alloc.IDs(); strings.Join(ids, ",") != "range-b,range-c" {
		t.Errorf("allocations after failed starts: %v", ids)
	}
	if ents, _ := os.ReadDir(d.uns.cfg.MountDir); len(ents) != 2 {
		t.Errorf("mount dirs after failed starts: %v", ents)
	}

	// A range whose sandbox runc never created (the process died in
	// between) is taken back by the next Driver; live ones stay.
	if _, err := d.uns.alloc.Acquire("range-orphan"); err != nil {
		t.Fatal(err)
	}
	if _, err := New(Config{Root: d.rc.Root, Logger: testLogger(t)}); err != nil {
		t.Fatal(err)
	}
	if ids, _ := d.uns.alloc.IDs(); strings.Join(ids, ",") != "range-b,range-c" {
		t.Errorf("allocations after a new Driver reaped orphans: %v", ids)
	}
}

// buildUsernsProbe compiles testdata/probe statically.
func buildUsernsProbe(t *testing.T) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "probe")
	cmd := exec.Command("go", "build", "-o", out, "./testdata/probe")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build probe: %v\n%s", err, b)
	}
	return out
}

// setHostInotify sets the host's per-user inotify instance limit and
// restores the old value when t ends.
func setHostInotify(t *testing.T, v int) {
	t.Helper()
	const file = "/proc/sys/fs/inotify/max_user_instances"
	old, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.WriteFile(file, old, 0) })
	if err := os.WriteFile(file, []byte(strconv.Itoa(v)), 0); err != nil {
		t.Fatal(err)
	}
}

// rootHeadroom returns how many more inotify instances host root can
// create right now.
func rootHeadroom(t *testing.T) int {
	t.Helper()
	var fds []int
	defer func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}()
	for len(fds) < 1<<20 {
		fd, err := unix.InotifyInit1(unix.IN_CLOEXEC)
		if err != nil {
			break
		}
		fds = append(fds, fd)
	}
	return len(fds)
}

// TestInotifyLimitPerSandbox: a sandbox creating inotify instances stops
// at its namespace's limit; spread over many of its users it stops at the
// host's per-user limit for its range's base UID (the namespace's owner);
// either way host root can still create one. Controls: without the
// namespace limit the loop goes on to the host limit (so the first stop
// was the namespace's), and without a user namespace the same loop takes
// every instance host root has left. The host limit is lowered to root's
// use plus a little, so each loop ends quickly.
func TestInotifyLimitPerSandbox(t *testing.T) {
	requireRoot(t)
	probe := buildUsernsProbe(t)
	parent := cgroupParent(t)
	const perSandbox, slack = 8, 24
	for _, tc := range []struct {
		name  string
		u     UserNS
		args  string
		check func(t *testing.T, n, limit int, hostErr error)
	}{
		{"namespace limit", UserNS{InotifyInstances: perSandbox}, "inotify 1000", func(t *testing.T, n, _ int, hostErr error) {
			if n != perSandbox || hostErr != nil {
				t.Fatalf("sandbox made %d instances (want %d); host root: %v", n, perSandbox, hostErr)
			}
		}},
		{"spread over 6 users", UserNS{InotifyInstances: perSandbox}, "inotify-uids 6 1000", func(t *testing.T, n, limit int, hostErr error) {
			if n != limit || hostErr != nil {
				t.Fatalf("sandbox made %d instances as 6 users (want the host's per-user limit %d); host root: %v", n, limit, hostErr)
			}
		}},
		{"control without namespace limit", UserNS{InotifyInstances: -1}, "inotify 1000", func(t *testing.T, n, limit int, hostErr error) {
			if n != limit || hostErr != nil {
				t.Fatalf("control: sandbox made %d instances (want the host limit %d); host root: %v", n, limit, hostErr)
			}
		}},
		{"control without user namespace", UserNS{Disabled: true}, "inotify 1000", func(t *testing.T, n, _ int, hostErr error) {
			if n < slack-4 || hostErr == nil {
				t.Fatalf("control: sandbox as host root made %d of root's %d spare instances and host root still got one (%v)", n, slack, hostErr)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newTestDriverWith(t, tc.u)
			const probeLimit = 512 // above root's use (the kernel default is 128), below our fd limit
			setHostInotify(t, probeLimit)
			limit := probeLimit - rootHeadroom(t) + slack
			setHostInotify(t, limit)
			spec := sleepSpec(t, parent, "inotify-"+strconv.Itoa(len(tc.name)))
			copyFile(t, probe, filepath.Join(spec.RootFS, "bin/probe"))
			spec.Args = []string{"/bin/sh", "-c", "/bin/probe " + tc.args + " > /tmp/out"}
			startSleep(t, d, spec)
			var out string
			for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
				b, _ := os.ReadFile(filepath.Join(spec.RootFS, "tmp/out"))
				if out = strings.TrimSpace(string(b)); out != "" {
					break
				}
			}
			n, _ := strconv.Atoi(strings.Fields(out + " 0")[0])
			fd, herr := unix.InotifyInit1(unix.IN_CLOEXEC)
			if herr == nil {
				unix.Close(fd)
			}
			t.Logf("host per-user limit %d; sandbox: %s; host root then: %v", limit, out, herr)
			tc.check(t, n, limit, herr)
		})
	}
}

// TestNoNestedUserNS: `unshare -Urn true` fails in a sandbox because its
// namespace allows no nested user namespace (ENOSPC), with the seccomp
// filter that also refuses it taken away, so the row proves the
// namespace limit alone. Control: the same probe succeeds where the limit
// is left alone (seccomp also off). The production sandbox (both) fails
// too.
func TestNoNestedUserNS(t *testing.T) {
	requireRoot(t)
	parent := cgroupParent(t)
	noSeccomp := func(sp *specs.Spec) { sp.Linux.Seccomp = nil }
	for _, tc := range []struct {
		name    string
		u       UserNS
		hook    func(*specs.Spec)
		allowed bool
	}{
		{"limit without seccomp", UserNS{}, noSeccomp, false},
		{"control: neither", UserNS{AllowNested: true}, noSeccomp, true},
		{"production", UserNS{}, nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newTestDriverWith(t, tc.u)
			d.specHook = tc.hook
			spec := sleepSpec(t, parent, "nested-"+strconv.Itoa(len(tc.name)))
			if err := os.Symlink("busybox", filepath.Join(spec.RootFS, "bin/unshare")); err != nil {
				t.Fatal(err)
			}
			startSleep(t, d, spec)
			out, err := runcExec(t, d, spec.ID, "/bin/unshare", "-Urn", "/bin/sh", "-c", "echo inside")
			switch {
			case tc.allowed && err != nil:
				t.Fatalf("control: unshare -Urn fails without the limit and seccomp too: %v: %s", err, out)
			case tc.allowed:
				t.Logf("control: unshare -Urn succeeds: %s", out)
			case err == nil:
				t.Fatalf("unshare -Urn succeeded: %s", out)
			default:
				t.Logf("unshare -Urn fails: %v: %s", err, out)
			}
		})
	}
}

// TestSysfsOfJoinedNetNS: a sandbox joining a network namespace made in
// the host's user namespace (as the network agent does) gets a read-only
// sysfs of that namespace, which its own user namespace could not mount,
// and ping stays open to all its groups.
func TestSysfsOfJoinedNetNS(t *testing.T) {
	requireRoot(t)
	name := namedNetNS(t, "cube-uns-")
	for _, args := range [][]string{{"link", "add", "cubedummy0", "type", "veth", "peer", "name", "cubedummy1"}, {"link", "set", "lo", "up"}} {
		if out, err := exec.Command("ip", append([]string{"-n", name}, args...)...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}
	parent := cgroupParent(t)
	d := newTestDriver(t)
	spec := sleepSpec(t, parent, "sysfs")
	spec.NetNSPath = "/run/netns/" + name
	copyFile(t, buildUsernsProbe(t), filepath.Join(spec.RootFS, "bin/probe"))
	st := startSleep(t, d, spec)

	out, err := nsenterIn(t, st.PID, "/bin/ls", "/sys/class/net")
	if err != nil || !strings.Contains(out, "cubedummy0") || strings.Contains(out, "eth0") {
		t.Fatalf("/sys/class/net in the sandbox: %v: %q, want the namespace's devices only", err, out)
	}
	t.Logf("/sys/class/net: %s", strings.Join(strings.Fields(out), " "))
	if out, err := nsenterIn(t, st.PID, "/bin/sh", "-c", "echo x > /sys/kernel/uevent_helper"); err == nil {
		t.Errorf("sysfs is writable in the sandbox: %s", out)
	}
	// The masks under /sys go on top of the host-side sysfs bound there.
	if out, err := nsenterIn(t, st.PID, "/bin/ls", "-A", "/sys/firmware"); err != nil || strings.TrimSpace(out) != "" {
		t.Errorf("/sys/firmware in the sandbox: %v: %q, want it masked (empty)", err, out)
	}
	// Set from the host side (the namespace's owner): the sandbox's
	// root may not, and its namespace cannot name host GIDs past its range.
	if out, err := exec.Command("ip", "netns", "exec", name, "cat", "/proc/sys/net/ipv4/ping_group_range").CombinedOutput(); err != nil ||
		strings.Join(strings.Fields(string(out)), " ") != "0 2147483647" {
		t.Errorf("ping_group_range of the sandbox's netns: %q, %v", out, err)
	}
	if out, err := nsenterIn(t, st.PID, "/bin/probe", "icmp"); err != nil {
		t.Errorf("ping from the sandbox (ICMP datagram socket): %v: %s", err, out)
	}
	if err := d.Stop(context.Background(), spec.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(d.uns.dir(spec.ID), "sys")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("sysfs mount point left after Stop: %v", err)
	}
}

// BenchmarkStartUserNS times Start (Stop excluded) of a busybox sandbox
// joining a network namespace, with and without the user namespace (and
// its limits): the difference is what the namespace adds to a create.
// p50-ms is the median Start.
//
//	go test -run XXX -bench StartUserNS -count 5 ./internal/runtime/runc/
func BenchmarkStartUserNS(b *testing.B) {
	testenv.RequireRoot(b, "runc creates namespaces and cgroups")
	name := namedNetNS(b, "cube-unsb-")
	for _, v := range []struct {
		name string
		u    UserNS
	}{
		{"userns", UserNS{}},
		{"userns-no-limits", UserNS{InotifyInstances: -1, InotifyWatches: -1, AllowNested: true}},
		{"no-userns", UserNS{Disabled: true}},
	} {
		b.Run(v.name, func(b *testing.B) {
			top, err := os.MkdirTemp("", "cube-runc-bench-")
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { _ = os.RemoveAll(top) })
			if err := os.Chmod(top, 0o711); err != nil {
				b.Fatal(err)
			}
			d, err := New(Config{Root: filepath.Join(top, "runc"), UserNS: v.u, Logger: slog.New(slog.DiscardHandler)})
			if err != nil {
				b.Fatal(err)
			}
			rootfs := filepath.Join(top, "rootfs")
			for _, dir := range []string{"bin", "proc", "sys", "dev", "tmp", "etc"} {
				if err := os.MkdirAll(filepath.Join(rootfs, dir), 0o755); err != nil {
					b.Fatal(err)
				}
			}
			if out, err := exec.Command("cp", "/bin/busybox", filepath.Join(rootfs, "bin/sleep")).CombinedOutput(); err != nil {
				b.Fatalf("%v: %s", err, out)
			}
			parent := "/cube-bench-" + strconv.Itoa(os.Getpid())
			b.Cleanup(func() { _, _ = cgroups.Remove(parent, 2*time.Second) })
			i := 0
			var took []time.Duration
			for b.Loop() {
				i++
				id := fmt.Sprintf("b%d", i)
				spec := runtime.Spec{
					ID: id, BundleDir: filepath.Join(top, id), RootFS: rootfs,
					Args: []string{"/bin/sleep", "1000"}, CgroupPath: parent + "/" + id,
					NetNSPath: "/run/netns/" + name,
				}
				begin := time.Now()
				if _, err := d.Start(context.Background(), spec); err != nil {
					b.Fatal(err)
				}
				took = append(took, time.Since(begin))
				b.StopTimer()
				if err := d.Stop(context.Background(), id); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			slices.Sort(took)
			b.ReportMetric(float64(took[len(took)/2].Microseconds())/1000, "p50-ms")
		})
	}
}
