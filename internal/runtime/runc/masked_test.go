package runc

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/testenv"
)

// mountsOf parses /proc/<pid>/mountinfo: mount point -> "fstype dev" of
// the last mount there (the one visible), and the set of devices.
func mountsOf(t *testing.T, pid int) (byPoint map[string][2]string, devs map[string]bool) {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		t.Fatal(err)
	}
	byPoint, devs = map[string][2]string{}, map[string]bool{}
	for line := range strings.Lines(string(b)) {
		pre, post, ok := strings.Cut(line, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if !ok || len(f) < 5 || len(g) < 1 {
			continue
		}
		byPoint[f[4]] = [2]string{g[0], f[2]}
		devs[f[2]] = true
	}
	return byPoint, devs
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
	if fw[0] == "tmpfs" {
		t.Fatalf("/sys/firmware is masked with a tmpfs (%s), want a bind", fw[1])
	}
	if !hostDevs[fw[1]] {
		t.Fatalf("/sys/firmware's mount is on device %s, which the host does not have mounted: a new superblock", fw[1])
	}
	if out := strings.TrimSpace(execIn(t, d, s.BundleDir, s.ID, 0, "/bin/ls", "-A", "/sys/firmware")); out != "" {
		t.Fatalf("/sys/firmware in the sandbox lists %q, want nothing", out)
	}
	if out := execIn(t, d, s.BundleDir, s.ID, 0, "/bin/sh", "-c", "mkdir /sys/firmware/x 2>&1; echo rc=$?"); !strings.Contains(out, "rc=1") {
		t.Fatalf("mkdir in the masked /sys/firmware: %q, want a refusal", out)
	}
	own := 0
	for dev := range devs {
		if !hostDevs[dev] {
			own++
		}
	}
	t.Logf("sandbox: /sys/firmware a bind (%s on %s), %d superblocks of its own", fw[0], fw[1], own)

	// Control: runc's own masking of the same directory.
	c := sleepSpec(t, parent, "mask-tmpfs")
	startWith(ctx, t, d, c, nil)
	cst, err := d.rc.State(ctx, c.ID)
	if err != nil {
		t.Fatal(err)
	}
	cm, cdevs := mountsOf(t, cst.Pid)
	if cm["/sys/firmware"][0] != "tmpfs" {
		t.Fatalf("control: runc masked /sys/firmware with %q, want tmpfs", cm["/sys/firmware"][0])
	}
	cown := 0
	for dev := range cdevs {
		if !hostDevs[dev] {
			cown++
		}
	}
	t.Logf("control (runc's masking): /sys/firmware a tmpfs, %d superblocks of its own", cown)

	if err := d.Stop(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(d.uns.dir(s.ID)); !os.IsNotExist(err) {
		t.Fatalf("sandbox directory after Stop: %v, want it removed", err)
	}
}
