package runc

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/runtime/userns"
)

// TestDroppedCapabilities: code in a runc sandbox cannot open a raw socket
// (forged packets, sniffing) nor create a device node, and every group
// may open ICMP datagram sockets instead (what iputils ping uses without
// CAP_NET_RAW; busybox's ping only knows raw sockets). Each probe's
// control is the same busybox command run on the host as root, where
// nothing stops it: the probe can fail for one reason only.
func TestDroppedCapabilities(t *testing.T) {
	requireRoot(t)
	parent := cgroupParent(t)
	d := newTestDriver(t)
	spec := sleepSpec(t, parent, "caps")
	probes := map[string]string{
		"raw":   "/bin/busybox traceroute -n -m 1 -w 1 127.0.0.1",
		"mknod": "/bin/busybox mknod /tmp/null c 1 3",
		"ping":  "/bin/busybox cat /proc/sys/net/ipv4/ping_group_range",
	}
	var script strings.Builder
	script.WriteString("/bin/busybox ip link set lo up; ")
	for name, cmd := range probes {
		script.WriteString(cmd + " >/tmp/" + name + ".out 2>&1; echo rc=$? >>/tmp/" + name + ".out; ")
	}
	script.WriteString("touch /tmp/done; exec /bin/sleep 1000000")
	spec.Args = []string{"/bin/sh", "-c", script.String()}
	t.Cleanup(func() { _ = d.Stop(context.Background(), spec.ID) })
	if _, err := d.Start(context.Background(), spec); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, err := os.Stat(filepath.Join(spec.RootFS, "tmp", "done")); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the probes never finished")
		}
		time.Sleep(50 * time.Millisecond)
	}
	out := func(name string) string {
		b, _ := os.ReadFile(filepath.Join(spec.RootFS, "tmp", name+".out"))
		return string(b)
	}
	for _, name := range []string{"raw", "mknod"} {
		got := out(name)
		if strings.Contains(got, "rc=0") || !strings.Contains(got, "not permitted") {
			t.Errorf("%s in the sandbox: %q, want refused (operation not permitted)", name, got)
		} else {
			t.Logf("%s in the sandbox: refused: %s", name, strings.TrimSpace(got))
		}
	}
	// Read inside the sandbox's user namespace: its groups are 0..65535.
	if got := strings.Fields(out("ping")); len(got) < 2 || got[0] != "0" || got[1] != strconv.Itoa(userns.Size-1) {
		t.Errorf("ping_group_range in the sandbox: %q, want every group of its namespace", got)
	}

	// Controls: the same commands where no capability is missing.
	host := t.TempDir()
	for name, cmd := range map[string]string{"raw": probes["raw"], "mknod": "/bin/busybox mknod " + filepath.Join(host, "null") + " c 1 3"} {
		f := strings.Fields(cmd)
		if b, err := exec.Command(f[0], f[1:]...).CombinedOutput(); err != nil {
			t.Errorf("control: %s as root on the host failed: %v: %s", name, err, b)
		}
	}
}
