package vm

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/testenv"
)

// TestNetworkTap boots a VM in a network namespace holding a slot-like
// tap0 (what network-agent makes) and reaches the agent over TCP at the
// slot's fixed guest address.
func TestNetworkTap(t *testing.T) {
	e := newEnv(t)
	testenv.RequireBinary(t, "ip", "iproute2")
	ns := fmt.Sprintf("cube-vmt-%d", os.Getpid())
	ip := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}
	ip("netns", "add", ns)
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", ns).Run() })
	ip("-n", ns, "tuntap", "add", "dev", network.TapName, "mode", "tap")
	ip("-n", ns, "addr", "add", network.SandboxGateway.String()+"/30", "dev", network.TapName)
	ip("-n", ns, "link", "set", network.TapName, "up")

	ctx := t.Context()
	s := e.spec(t, "net")
	s.NetNSPath = filepath.Join("/run/netns", ns)
	stopAtEnd(t, e.d, s.ID)
	st, err := e.d.Start(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	got, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/net", st.PID))
	self, _ := os.Readlink("/proc/self/ns/net")
	if got == self {
		t.Errorf("QEMU runs in the host's network namespace (%s)", got)
	}
	agentClient(ctx, t, e.d, s.ID, bootLimit)
	url := fmt.Sprintf("http://%s:49983/health", network.SandboxIP)
	deadline := time.Now().Add(30 * time.Second)
	var out []byte
	for {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		out, err = exec.CommandContext(cctx, "ip", "netns", "exec", ns, "/bin/busybox", "wget", "-q", "-O", "-", url).CombinedOutput()
		cancel()
		if err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("GET %s from the slot namespace: %v: %s", url, err, out)
	}
}
