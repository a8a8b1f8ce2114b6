package vmguest

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netns"

	"github.com/cubesandbox/cube/internal/agent/agenttest"
	"github.com/cubesandbox/cube/internal/agentchan"
	"github.com/cubesandbox/cube/internal/leakcheck"
	"github.com/cubesandbox/cube/internal/testenv"
)

// TestBootAgentChannel boots one real VM: the built kernel and initramfs,
// an ext4 root made from busybox and a static cube-agent, QEMU microvm
// (-accel from CUBE_VM_ACCEL, tcg by default), and checks the agent over
// the serial channel, across a host reconnect, and over TCP through a TAP.
func TestBootAgentChannel(t *testing.T) {
	requireTools(t)
	for _, tool := range []string{"qemu-system-x86_64", "mkfs.ext4", "ip"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Missing(t, "%s not installed", tool)
		}
	}
	accel := os.Getenv("CUBE_VM_ACCEL")
	if accel == "" {
		accel = "tcg"
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	a, err := Build(ctx, BuildConfig{OutDir: TestGuestDir, CacheDir: testCacheDir})
	if err != nil {
		t.Fatal(err)
	}

	runDir := t.TempDir()
	bundle := filepath.Join(runDir, "sandboxes", "vm1")
	if err := os.MkdirAll(bundle, 0o755); err != nil {
		t.Fatal(err)
	}
	// Runs last: everything below must be gone by then.
	t.Cleanup(func() {
		leakcheck.AssertNone(t, context.Background(), leakcheck.Scope{RunDir: runDir})
		if _, err := os.Stat("/var/run/netns/" + nsName(t)); err == nil {
			t.Errorf("netns %s left behind", nsName(t))
		}
	})
	t.Cleanup(func() { os.RemoveAll(bundle) })
	img := rootImage(t, bundle)

	ns := nsName(t)
	ipCmd(t, "netns", "add", ns)
	t.Cleanup(func() {
		if out, err := exec.Command("ip", "netns", "del", ns).CombinedOutput(); err != nil {
			t.Errorf("ip netns del %s: %v: %s", ns, err, out)
		}
	})
	ipCmd(t, "-n", ns, "tuntap", "add", "tap0", "mode", "tap")
	ipCmd(t, "-n", ns, "addr", "add", "169.254.0.22/30", "dev", "tap0")
	ipCmd(t, "-n", ns, "link", "set", "tap0", "up")
	ipCmd(t, "-n", ns, "link", "set", "lo", "up")

	sock := filepath.Join(bundle, "agent.sock")
	console := filepath.Join(bundle, "console.log")
	cmdline := Cmdline(CmdlineOptions{TCG: accel == "tcg", Hostname: "vm-test", Net: &NetConfig{
		Addr: netip.MustParsePrefix("169.254.0.21/30"), Gateway: netip.MustParseAddr("169.254.0.22")}, Extra: strings.Fields(os.Getenv("CUBE_VM_EXTRA_CMDLINE"))})
	// -icount: under TCG on a loaded host the kernel's PIT calibration
	// fails and boot hangs without it (docs/vm.md).
	accelArgs := []string{"-accel", "tcg", "-icount", "shift=auto", "-cpu", "max"}
	if accel == "kvm" {
		accelArgs = []string{"-accel", "kvm", "-cpu", "host"}
	}
	qemu := exec.Command("ip", append(append([]string{"netns", "exec", ns, "qemu-system-x86_64",
		"-M", "microvm"}, accelArgs...), "-m", "256", "-smp", "1",
		"-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
		"-serial", "file:"+console,
		"-kernel", a.Kernel, "-initrd", a.Initrd, "-append", cmdline,
		"-drive", "id=root,file="+img+",format=raw,if=none", "-device", "virtio-blk-device,drive=root",
		"-netdev", "tap,id=net0,ifname=tap0,script=no,downscript=no,vhost=off",
		"-device", "virtio-net-device,netdev=net0",
		"-chardev", "socket,id=agent,path="+sock+",server=on,wait=off",
		"-device", "virtio-serial-device", "-device", "virtserialport,chardev=agent,name="+agentchan.PortName,
		"-device", "virtio-rng-device")...)
	qemu.Stderr = os.Stderr
	qemu.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	start := time.Now()
	if err := qemu.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = qemu.Process.Kill() // fails only if it already exited
		_ = qemu.Wait()         // killed: the status is the signal
	})
	t.Cleanup(func() {
		if t.Failed() {
			b, _ := os.ReadFile(console)
			t.Logf("console log:\n%s", b)
		}
	})

	// Cold boot to agent-ready, over the serial channel.
	c := agentchan.SerialClient(sock)
	waitHealthy(ctx, t, c, time.Minute)
	t.Logf("cold boot to agent-ready (%s, accel %s): %v", a.KernelVersion, accel, time.Since(start).Round(time.Millisecond))

	out := runCmd(ctx, t, c, "hostname; cat /proc/1/comm; ls /dev/virtio-ports /dev/vport* 2>/dev/null | head -1")
	if !strings.HasPrefix(out, "vm-test\ncube-agent\n") {
		t.Fatalf("process output %q", out)
	}

	// The host end goes away and comes back (a new client on the same
	// socket, as after a cubelet restart or a restore).
	c.CloseIdleConnections()
	for i := range 3 {
		c2 := agentchan.SerialClient(sock)
		t0 := time.Now()
		waitHealthy(ctx, t, c2, 10*time.Second)
		t.Logf("reconnect %d: healthy after %v", i, time.Since(t0).Round(time.Millisecond))
		c2.CloseIdleConnections()
	}
	c3 := agentchan.SerialClient(sock)
	if got := runCmd(ctx, t, c3, "echo again"); got != "again\n" {
		t.Fatalf("after reconnect: %q", got)
	}
	c3.CloseIdleConnections()

	// The E2B path: TCP through the TAP, from inside the namespace.
	code, err := inNetns(ns, func() (int, error) {
		// Dial here: http.Transport would dial on another thread, in
		// the host's namespace.
		conn, err := net.DialTimeout("tcp", "169.254.0.21:49983", 10*time.Second)
		if err != nil {
			return 0, err
		}
		defer conn.Close()
		if err := conn.SetDeadline(time.Now().Add(10 * time.Second)); err != nil {
			return 0, err
		}
		if _, err := io.WriteString(conn, "GET /health HTTP/1.1\r\nHost: sandbox\r\nConnection: close\r\n\r\n"); err != nil {
			return 0, err
		}
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			return 0, err
		}
		resp.Body.Close()
		return resp.StatusCode, nil
	})
	if err != nil || code != http.StatusNoContent {
		t.Fatalf("TCP /health through the TAP: %d, %v", code, err)
	}
}

func nsName(t *testing.T) string { return fmt.Sprintf("cube-vmguest-%d", os.Getpid()) }

func ipCmd(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		t.Fatalf("ip %v: %v: %s", args, err, out)
	}
}

// rootImage makes a 64 MiB ext4 root with busybox and a static cube-agent,
// without mounting anything (mkfs.ext4 -d).
func rootImage(t *testing.T, dir string) string {
	t.Helper()
	root := filepath.Join(dir, "rootfs")
	for _, d := range []string{"bin", "etc", "root", "usr/local/bin", "proc", "sys", "dev", "run", "tmp"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	bb, err := os.ReadFile(DefaultBusybox)
	if err != nil {
		testenv.Missing(t, "busybox-static: %v", err)
	}
	if err := os.WriteFile(filepath.Join(root, "bin/busybox"), bb, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, a := range []string{"sh", "ls", "cat", "echo", "hostname", "head", "sleep", "ip"} {
		if err := os.Symlink("busybox", filepath.Join(root, "bin", a)); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(root, "etc/passwd"), []byte("root:x:0:0:root:/root:/bin/sh\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "etc/group"), []byte("root:x:0:\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	build := exec.Command("go", "build", "-o", filepath.Join(root, "usr/local/bin/cube-agent"), "github.com/cubesandbox/cube/cmd/cube-agent")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build cube-agent: %v: %s", err, out)
	}
	img := filepath.Join(dir, "root.ext4")
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-d", root, img, "64M").CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v: %s", err, out)
	}
	os.RemoveAll(root)
	return img
}

func waitHealthy(ctx context.Context, t *testing.T, c *http.Client, limit time.Duration) {
	t.Helper()
	if err := agenttest.WaitHealthy(ctx, c, agentchan.BaseURL, limit); err != nil {
		t.Fatalf("agent over the channel: %v", err)
	}
}

func runCmd(ctx context.Context, t *testing.T, c *http.Client, script string) string {
	t.Helper()
	return agenttest.Shell(ctx, t, c, agentchan.BaseURL, script)
}

// inNetns runs fn on a thread inside the named network namespace.
func inNetns(name string, fn func() (int, error)) (int, error) {
	type res struct {
		code int
		err  error
	}
	ch := make(chan res, 1)
	go func() {
		// The thread is left locked, so the runtime discards it rather
		// than reuse it in the wrong namespace.
		runtime.LockOSThread()
		h, err := netns.GetFromName(name)
		if err != nil {
			ch <- res{0, err}
			return
		}
		defer h.Close()
		if err := netns.Set(h); err != nil {
			ch <- res{0, err}
			return
		}
		code, err := fn()
		ch <- res{code, err}
	}()
	r := <-ch
	return r.code, r.err
}
