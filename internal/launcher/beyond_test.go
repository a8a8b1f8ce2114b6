package launcher_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/pki"
	"github.com/cubesandbox/cube/internal/storage"
)

// TestDaemonsRefusePlaintextBeyondLoopback starts the daemons' binaries
// (what `cube up` runs) in a network namespace of their own with an
// address on a veth interface, each with one listener on that address
// and no TLS: each refuses to start and names the setting. The control,
// the same configuration with that listener's TLS set, starts and listens
// on the address (read from the namespace's /proc/<pid>/net/tcp), so the
// refusal is the missing TLS and not the address.
func TestDaemonsRefusePlaintextBeyondLoopback(t *testing.T) {
	nettest.RequireRoot(t)
	bin := binaries(t)
	netAgent := nettest.ReleaseBinary(t)
	id := randomHex(3)
	ns := "cube-lm-" + id
	b := []byte(id)
	addr := fmt.Sprintf("10.%d.%d.%d", 200+int(b[0])%50, b[1], 1+int(b[2])%250)
	for _, args := range [][]string{
		{"netns", "add", ns},
		{"-n", ns, "link", "set", "lo", "up"},
		// A veth pair inside the namespace (this kernel has no dummy
		// driver): an ordinary interface address, not loopback.
		{"-n", ns, "link", "add", "a0", "type", "veth", "peer", "name", "b0"},
		{"-n", ns, "addr", "add", addr + "/24", "dev", "a0"},
		{"-n", ns, "link", "set", "a0", "up"},
		{"-n", ns, "link", "set", "b0", "up"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v\n%s", args, err, out)
		}
		if args[0] == "netns" {
			t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", ns).Run() })
		}
	}
	// cubelet's run dir must be searchable by other users (runc's mapped
	// roots): not under t.TempDir, whose parent is 0700.
	dir, err := os.MkdirTemp("", "cube-beyond-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o711); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if p, err := storage.OpenPool(context.Background(), storage.PoolConfig{Dir: filepath.Join(dir, "cubelet-data", "pool"), ImageSizeBytes: 1 << 30}); err == nil {
			_ = p.Teardown(context.Background())
		}
	})
	ca, err := pki.NewCA("beyond loopback test")
	if err != nil {
		t.Fatal(err)
	}
	master, err := ca.Issue(dir, "master", "cubemaster", pki.RoleMaster, addr)
	if err != nil {
		t.Fatal(err)
	}
	tlsTable := fmt.Sprintf("[tls]\ncert = %q\nkey = %q\nca = %q\n", master.Cert, master.Key, master.CA)
	port := 20000
	next := func() string { port++; return strconv.Itoa(port) }

	type tc struct {
		daemon, bin, setting string
		config, control      func(hostport string) string
	}
	// One listener on the namespace's address per case, the others on its
	// loopback.
	cases := []tc{
		{"cubemaster", filepath.Join(bin, "cubemaster"), "api.e2b", func(hp string) string {
			return fmt.Sprintf("[api]\ne2b = %q\nnode = \"\"\nsocket = %q\n[proxy]\nlisten = \"127.0.0.1:%s\"\n[catalog]\ndriver = \"sqlite\"\ndsn = %q\n",
				hp, filepath.Join(dir, "m-"+next()+".sock"), next(), filepath.Join(dir, "c-"+next()+".db"))
		}, func(hp string) string {
			return fmt.Sprintf("[api]\ne2b = %q\ne2b_tls_cert = %q\ne2b_tls_key = %q\nnode = \"\"\nsocket = %q\n[proxy]\nlisten = \"127.0.0.1:%s\"\n[catalog]\ndriver = \"sqlite\"\ndsn = %q\n",
				hp, master.Cert, master.Key, filepath.Join(dir, "m-"+next()+".sock"), next(), filepath.Join(dir, "c-"+next()+".db"))
		}},
		{"cubemaster", filepath.Join(bin, "cubemaster"), "api.node", func(hp string) string {
			return fmt.Sprintf("[api]\ne2b = \"127.0.0.1:%s\"\nnode = %q\nsocket = %q\n[proxy]\nlisten = \"127.0.0.1:%s\"\n[catalog]\ndriver = \"sqlite\"\ndsn = %q\n",
				next(), hp, filepath.Join(dir, "m-"+next()+".sock"), next(), filepath.Join(dir, "c-"+next()+".db"))
		}, func(hp string) string {
			return fmt.Sprintf("[api]\ne2b = \"127.0.0.1:%s\"\nnode = %q\nsocket = %q\n[proxy]\nlisten = \"127.0.0.1:%s\"\n[catalog]\ndriver = \"sqlite\"\ndsn = %q\n%s",
				next(), hp, filepath.Join(dir, "m-"+next()+".sock"), next(), filepath.Join(dir, "c-"+next()+".db"), tlsTable)
		}},
		{"cubemaster", filepath.Join(bin, "cubemaster"), "proxy.listen", func(hp string) string {
			return fmt.Sprintf("[api]\ne2b = \"127.0.0.1:%s\"\nnode = \"\"\nsocket = %q\n[proxy]\nlisten = %q\n[catalog]\ndriver = \"sqlite\"\ndsn = %q\n",
				next(), filepath.Join(dir, "m-"+next()+".sock"), hp, filepath.Join(dir, "c-"+next()+".db"))
		}, func(hp string) string {
			return fmt.Sprintf("[api]\ne2b = \"127.0.0.1:%s\"\nnode = \"\"\nsocket = %q\n[proxy]\nlisten = %q\ntls_cert = %q\ntls_key = %q\n[catalog]\ndriver = \"sqlite\"\ndsn = %q\n",
				next(), filepath.Join(dir, "m-"+next()+".sock"), hp, master.Cert, master.Key, filepath.Join(dir, "c-"+next()+".db"))
		}},
		{"cubemaster", filepath.Join(bin, "cubemaster"), "proxy.metrics", func(hp string) string {
			return fmt.Sprintf("[api]\ne2b = \"127.0.0.1:%s\"\nnode = \"\"\nsocket = %q\n[proxy]\nlisten = \"127.0.0.1:%s\"\nmetrics = %q\n[catalog]\ndriver = \"sqlite\"\ndsn = %q\n",
				next(), filepath.Join(dir, "m-"+next()+".sock"), next(), hp, filepath.Join(dir, "c-"+next()+".db"))
		}, func(hp string) string {
			return fmt.Sprintf("[api]\ne2b = \"127.0.0.1:%s\"\nnode = \"\"\nsocket = %q\n[proxy]\nlisten = \"127.0.0.1:%s\"\nmetrics = %q\ntls_cert = %q\ntls_key = %q\n[catalog]\ndriver = \"sqlite\"\ndsn = %q\n",
				next(), filepath.Join(dir, "m-"+next()+".sock"), next(), hp, master.Cert, master.Key, filepath.Join(dir, "c-"+next()+".db"))
		}},
		{"cubelet", filepath.Join(bin, "cubelet"), "api.tcp", func(hp string) string {
			return cubeletConfig(dir, id, next(), "metrics = \"\"\ntcp = "+strconv.Quote(hp), "")
		}, func(hp string) string {
			return cubeletConfig(dir, id, next(), "metrics = \"\"\ntcp = "+strconv.Quote(hp), tlsTable)
		}},
		{"cubelet", filepath.Join(bin, "cubelet"), "api.metrics", func(hp string) string {
			return cubeletConfig(dir, id, next(), "tcp = \"\"\nmetrics = "+strconv.Quote(hp), "")
		}, func(hp string) string {
			return cubeletConfig(dir, id, next(), "tcp = \"\"\nmetrics = "+strconv.Quote(hp), tlsTable)
		}},
		{"network-agent", netAgent, "api.http", func(hp string) string {
			return networkAgentConfig(dir, id, next(), hp, "")
		}, func(hp string) string {
			return networkAgentConfig(dir, id, next(), hp, tlsTable)
		}},
	}
	for _, c := range cases {
		hp := addr + ":" + next()
		// Without TLS: refused at start, naming the setting.
		out, code, pid := runInNetns(t, ns, c.bin, filepath.Join(dir, "cfg-"+next()+".toml"), c.config(hp), "", 20*time.Second)
		if pid != 0 || code == 0 || !strings.Contains(out, "beyond loopback") || !strings.Contains(out, c.setting) {
			t.Errorf("%s %s = %s without TLS: exit %d, still running: %v; output:\n%s", c.daemon, c.setting, hp, code, pid != 0, out)
		} else {
			t.Logf("%s %s = %s without TLS: refused (exit %d): %s", c.daemon, c.setting, hp, code, lastLine(out, "beyond loopback"))
		}
		// Control: with TLS it listens there.
		out, _, pid = runInNetns(t, ns, c.bin, filepath.Join(dir, "cfg-"+next()+".toml"), c.control(hp), hp, 20*time.Second)
		if pid == 0 {
			t.Errorf("control: %s %s = %s with TLS did not listen; output:\n%s", c.daemon, c.setting, hp, out)
		} else {
			t.Logf("control: %s %s = %s with TLS: listening (pid %d)", c.daemon, c.setting, hp, pid)
		}
	}
}

// cubeletConfig: a standalone node (no master) whose state every case
// shares; api is its TCP listener lines.
func cubeletConfig(dir, id, n, api, extra string) string {
	return fmt.Sprintf("[node]\nid = \"lb-%[1]s\"\ndata_dir = %[2]q\nrun_dir = %[3]q\ncgroup_parent = \"cube-test-lb%[1]s\"\n"+
		"[api]\nsocket = %[4]q\n%[5]s\n[master]\naddr = \"\"\n[storage]\npool_image_size_mib = 4096\ntemplate_headroom_mib = 32\n%[6]s",
		id, filepath.Join(dir, "cubelet-data"), filepath.Join(dir, "cubelet-run"), filepath.Join(dir, "cl-"+n+".sock"), api, extra)
}

func networkAgentConfig(dir, id, n, hp, extra string) string {
	return fmt.Sprintf("node_cidr = \"10.255.%d.0/24\"\nprefix = \"lb%s\"\nrun_dir = %q\ndata_dir = %q\n[api]\nsocket = %q\nhttp = %q\n[pool]\nsize = 0\nvm_size = 0\n%s",
		len(n)*10%250, id[:4], filepath.Join(dir, "na-run-"+n), filepath.Join(dir, "na-data-"+n), filepath.Join(dir, "na-"+n+".sock"), hp, extra)
}

// runInNetns runs bin --config <config> in the namespace ns. With listen
// empty it waits for the process to exit and returns its output and exit
// code; otherwise it waits until the process listens on listen (in its
// namespace's /proc/<pid>/net/tcp), returns its pid and stops it. pid is
// 0 when it did not listen or exited.
func runInNetns(t *testing.T, ns, bin, cfgPath, config, listen string, d time.Duration) (out string, code, pid int) {
	t.Helper()
	if err := os.WriteFile(cfgPath, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	var buf syncBuffer
	cmd := exec.Command("ip", "netns", "exec", ns, bin, "--config", cfgPath)
	cmd.Stdout, cmd.Stderr = &buf, &buf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	stop := func() {
		_ = cmd.Process.Signal(os.Interrupt)
		var err error
		select {
		case err = <-done:
		case <-time.After(15 * time.Second):
			_ = cmd.Process.Kill()
			err = <-done
		}
		t.Logf("%s stopped: %v", filepath.Base(bin), err)
	}
	deadline := time.After(d)
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case err := <-done:
			code = -1
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				code = ee.ExitCode()
			} else if err == nil {
				code = 0
			}
			return buf.String(), code, 0
		case <-deadline:
			stop()
			return buf.String(), 0, 0
		case <-tick.C:
			if listen != "" && listensIn(cmd.Process.Pid, listen) {
				p := cmd.Process.Pid
				stop()
				return buf.String(), 0, p
			}
		}
	}
}

// listensIn: pid's network namespace has a TCP socket listening on
// hostport.
func listensIn(pid int, hostport string) bool {
	want, err := netip.ParseAddrPort(hostport)
	if err != nil {
		return false
	}
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/tcp", pid))
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(raw), "\n")[1:] {
		fs := strings.Fields(line)
		if len(fs) < 4 || fs[3] != "0A" {
			continue
		}
		a, err := decodeHexAddr(fs[1])
		if err != nil {
			continue
		}
		if got, err := netip.ParseAddrPort(a); err == nil && got == want {
			return true
		}
	}
	return false
}

func lastLine(out, sub string) string {
	lines := strings.Split(out, "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if strings.Contains(lines[i], sub) {
			return strings.TrimSpace(lines[i])
		}
	}
	return ""
}
