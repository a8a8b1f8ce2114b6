package runc

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/testenv"
)

// mountInfo is one line of /proc/<pid>/mountinfo.
type mountInfo struct{ root, dev, opts, fstype string }

// mountsOf parses /proc/<pid>/mountinfo: the mount visible at each mount
// point (the last one there), and the set of devices.
func mountsOf(t *testing.T, pid int) (byPoint map[string]mountInfo, devs map[string]bool) {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		t.Fatal(err)
	}
	byPoint, devs = map[string]mountInfo{}, map[string]bool{}
	for line := range strings.Lines(string(b)) {
		pre, post, ok := strings.Cut(line, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if !ok || len(f) < 6 || len(g) < 1 {
			continue
		}
		byPoint[f[4]] = mountInfo{root: f[3], dev: f[2], opts: f[5], fstype: g[0]}
		devs[f[2]] = true
	}
	return byPoint, devs
}

// notIn counts the devices of devs that host lacks: a sandbox's
// superblocks of its own.
func notIn(devs, host map[string]bool) int {
	n := 0
	for dev := range devs {
		if !host[dev] {
			n++
		}
	}
	return n
}

// The directories under /sys that a sandbox must not see (/sys/firmware
// here) are masked with a read-only bind of an empty directory, not with
// a tmpfs each: a tmpfs is a superblock per sandbox, and the kernel's
// memory per memory cgroup grows with the number of superblocks on the
// host. The control starts the same spec through runc without the
// driver's step: there /sys/firmware is a tmpfs, one superblock more.
func TestMaskedSysDirsAreBinds(t *testing.T) {
	requireRoot(t)
	if !isDir("/sys/firmware") {
		testenv.Missing(t, "the host has no /sys/firmware to mask")
	}
	d := newTestDriver(t)
	parent := cgroupParent(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	s := sleepSpec(t, parent, "mask-bind")
	t.Cleanup(func() { _ = d.Stop(context.Background(), s.ID) })
	st, err := d.Start(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	_, hostDevs := mountsOf(t, os.Getpid())
	mnts, devs := mountsOf(t, st.PID)
	fw, ok := mnts["/sys/firmware"]
	if !ok {
		t.Fatal("nothing mounted over /sys/firmware in the sandbox: it is not masked")
	}
	if !strings.HasSuffix(fw.root, "/masked") {
		t.Fatalf("/sys/firmware shows %q of its filesystem (%s), want the driver's empty masked directory", fw.root, fw.fstype)
	}
	if !hostDevs[fw.dev] {
		t.Fatalf("/sys/firmware's mount is on device %s, which the host does not have mounted: a new superblock", fw.dev)
	}
	if !slices.Contains(strings.Split(fw.opts, ","), "ro") {
		t.Fatalf("/sys/firmware's bind is mounted %q, want read-only", fw.opts)
	}
	if out := strings.TrimSpace(execIn(t, d, s.BundleDir, s.ID, 0, "/bin/ls", "-A", "/sys/firmware")); out != "" {
		t.Fatalf("/sys/firmware in the sandbox lists %q, want nothing", out)
	}
	if out := execIn(t, d, s.BundleDir, s.ID, 0, "/bin/sh", "-c", "mkdir /sys/firmware/x 2>&1; echo rc=$?"); !strings.Contains(out, "rc=1") {
		t.Fatalf("mkdir in the masked /sys/firmware: %q, want a refusal", out)
	}
	own := notIn(devs, hostDevs)
	t.Logf("sandbox: /sys/firmware a read-only bind of %s (%s on %s), %d superblocks of its own", fw.root, fw.fstype, fw.dev, own)

	// Control: runc's own masking of the same directory.
	c := sleepSpec(t, parent, "mask-tmpfs")
	startWith(ctx, t, d, c, nil)
	cst, err := d.rc.State(ctx, c.ID)
	if err != nil {
		t.Fatal(err)
	}
	cm, cdevs := mountsOf(t, cst.Pid)
	if m := cm["/sys/firmware"]; m.fstype != "tmpfs" || hostDevs[m.dev] {
		t.Fatalf("control: runc masked /sys/firmware with %+v, want a tmpfs of its own", m)
	}
	cown := notIn(cdevs, hostDevs)
	t.Logf("control (runc's masking): /sys/firmware a tmpfs, %d superblocks of its own", cown)

	if err := d.Stop(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(d.uns.dir(s.ID)); !os.IsNotExist(err) {
		t.Fatalf("sandbox directory after Stop: %v, want it removed", err)
	}
}
