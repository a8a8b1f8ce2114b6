package runc

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/runtime"
)

// tmpfsAt mounts a tmpfs at dir (made if missing), detached with
// everything under it when t ends.
func tmpfsAt(t *testing.T, dir string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o711); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "mode=0711"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
}

// mountPointsIn lists the mount points of the mount namespace at nsfd,
// or of this process's when nsfd < 0.
func mountPointsIn(t *testing.T, nsfd int) map[string]bool {
	t.Helper()
	points := map[string]bool{}
	err := onThrowawayThread(func() error {
		if nsfd >= 0 {
			if err := unix.Unshare(unix.CLONE_FS); err != nil {
				return err
			}
			if err := unix.Setns(nsfd, unix.CLONE_NEWNS); err != nil {
				return err
			}
		}
		ms, err := threadMounts()
		for _, m := range ms {
			points[m.Mountpoint] = true
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return points
}

func TestLaunchNamespaceKeepsOnlyWhatRuncNeeds(t *testing.T) {
	requireRoot(t)
	dir := searchableDir(t)
	base := filepath.Join(dir, "base")
	tmpfsAt(t, base)
	keep := filepath.Join(base, "runc")
	if err := os.Mkdir(keep, 0o700); err != nil {
		t.Fatal(err)
	}
	sandbox := filepath.Join(base, "sandbox-disk")
	tmpfsAt(t, sandbox)
	other := filepath.Join(dir, "other-program")
	tmpfsAt(t, other)

	l, err := newLaunchNS([]string{keep}, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.close)
	later := filepath.Join(base, "later")
	tmpfsAt(t, later)

	host := mountPointsIn(t, -1)
	got := mountPointsIn(t, l.ns)
	for _, p := range []string{sandbox, other, later} {
		if !host[p] {
			t.Fatalf("control: the host shows no mount at %s", p)
		}
		if got[p] {
			t.Errorf("the launch namespace holds %s: it would pin that file system", p)
		}
	}
	want := []string{"/", base, "/proc", "/dev"}
	if host["/sys/fs/cgroup"] {
		want = append(want, "/sys/fs/cgroup")
	}
	for _, p := range want {
		if !got[p] {
			t.Errorf("the launch namespace has no mount at %s", p)
		}
	}
	if len(got) >= len(host) {
		t.Errorf("the launch namespace has %d mounts, the host %d", len(got), len(host))
	}
}

// TestRuncStartsFromLaunchNamespace starts a sandbox on a host with many
// mounts and has a createRuntime hook (run by runc, in its own mount
// namespace) count the mounts runc sees; the control does the same with
// runc started from this process's namespace.
func TestRuncStartsFromLaunchNamespace(t *testing.T) {
	requireRoot(t)
	const extra = 300
	many := filepath.Join(searchableDir(t), "many")
	tmpfsAt(t, many)
	for i := range extra {
		p := filepath.Join(many, strconv.Itoa(i))
		if err := os.Mkdir(p, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mount(many, p, "", unix.MS_BIND, ""); err != nil {
			t.Fatal(err)
		}
	}
	// A bind source on a mount the launch namespace does not keep: it
	// reaches the sandbox through a clone staged next to its root.
	src := filepath.Join(many, "0", "shared.txt")
	if err := os.WriteFile(src, []byte("from the host\n"), 0o644); err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		name     string
		noLaunch bool
	}{{"launch namespace", false}, {"control: this process's namespace", true}} {
		t.Run(tc.name, func(t *testing.T) {
			d := newTestDriver(t)
			if tc.noLaunch {
				d.launch = nil
			} else if d.launch == nil {
				t.Fatal("the driver made no launch namespace")
			}
			parent := cgroupParent(t)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			s := sleepSpec(t, parent, "launch-ns")
			s.Mounts = []runtime.Mount{{Source: src, Destination: "/etc/shared.txt", ReadOnly: true}}
			count := filepath.Join(s.BundleDir, "runtime-mounts")
			d.specHook = func(sp *specs.Spec) {
				sp.Hooks = &specs.Hooks{CreateRuntime: []specs.Hook{{
					Path: "/bin/sh",
					Args: []string{"sh", "-c", "wc -l < /proc/self/mountinfo > " + count},
				}}}
			}
			t.Cleanup(func() { _ = d.Stop(context.Background(), s.ID) })
			st, err := d.Start(ctx, s)
			if err != nil {
				t.Fatal(err)
			}
			b, err := os.ReadFile(count)
			if err != nil {
				t.Fatal(err)
			}
			n, err := strconv.Atoi(strings.TrimSpace(string(b)))
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("runc saw %d mounts; the host has %d", n, len(mountPointsIn(t, -1)))
			if tc.noLaunch && n < extra {
				t.Fatalf("control: runc saw %d mounts, want the host's %d and more", n, extra)
			}
			if !tc.noLaunch && n >= extra {
				t.Fatalf("runc saw %d mounts: it started among the host's", n)
			}
			got, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(st.PID), "root/etc/shared.txt"))
			if err != nil || string(got) != "from the host\n" {
				t.Fatalf("the sandbox reads %q (%v) from its bind mount", got, err)
			}
			if _, err := os.Stat(filepath.Join(d.uns.dir(s.ID), "launch")); !os.IsNotExist(err) {
				t.Errorf("the staging directory outlived the start: %v", err)
			}
		})
	}
}

// TestNetNSPathOutsideLaunchNamespace starts a sandbox without a user
// namespace that joins a network namespace bound under /run/netns, a
// mount the launch namespace does not keep: runc joins it through this
// process's descriptor of it.
func TestNetNSPathOutsideLaunchNamespace(t *testing.T) {
	requireRoot(t)
	name := namedNetNS(t, "cube-launch-")
	d := newTestDriverWith(t, UserNS{Disabled: true})
	if d.launch == nil {
		t.Fatal("the driver made no launch namespace")
	}
	spec := sleepSpec(t, cgroupParent(t), "launch-netns")
	spec.NetNSPath = "/run/netns/" + name
	st := startSleep(t, d, spec)
	want, err := os.Readlink(spec.NetNSPath)
	if err != nil {
		var s unix.Stat_t
		if err := unix.Stat(spec.NetNSPath, &s); err != nil {
			t.Fatal(err)
		}
		want = "net:[" + strconv.FormatUint(s.Ino, 10) + "]"
	}
	got, err := os.Readlink(filepath.Join("/proc", strconv.Itoa(st.PID), "ns/net"))
	if err != nil || got != want {
		t.Fatalf("the sandbox's network namespace is %q (%v), want %s's %q", got, err, spec.NetNSPath, want)
	}
}

// TestStaleLaunchNamespaceIsDropped replaces runc's root on the host
// after the driver started (a mount over it): the launch namespace no
// longer shows it, and every runc command, not just the start, goes to
// this process's namespace, so Stop finds what Start made.
func TestStaleLaunchNamespaceIsDropped(t *testing.T) {
	requireRoot(t)
	d := newTestDriver(t)
	if d.launch == nil {
		t.Fatal("the driver made no launch namespace")
	}
	tmpfsAt(t, d.rc.Root)
	spec := sleepSpec(t, cgroupParent(t), "launch-stale")
	st, err := d.Start(context.Background(), spec)
	if err != nil {
		t.Fatal(err)
	}
	if !d.launch.stale.Load() {
		t.Error("the launch namespace is still in use with runc's root replaced on the host")
	}
	if _, err := os.Stat(filepath.Join(d.rc.Root, spec.ID)); err != nil {
		t.Errorf("runc's state is not under the host's root: %v", err)
	}
	if err := d.Stop(context.Background(), spec.ID); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(st.PID), "stat")); err == nil && !strings.Contains(string(b), ") Z ") {
		t.Errorf("PID 1 (%d) still runs after Stop: %s", st.PID, b)
	}
	if _, err := os.Stat(filepath.Join(d.rc.Root, spec.ID)); !os.IsNotExist(err) {
		t.Errorf("runc's state outlived Stop: %v", err)
	}
	if _, ok, _ := d.uns.alloc.Get(spec.ID); ok {
		t.Error("the sandbox's ID range is still taken after Stop")
	}
}
