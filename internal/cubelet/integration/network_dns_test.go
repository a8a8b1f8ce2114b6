package integration

import (
	"context"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/miekg/dns"

	pb "github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/network/policy"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/testenv"
	"github.com/cubesandbox/cube/internal/vmguest"
)

// shIn runs a shell script in the sandbox through its agent (the slot's
// host IP, as the proxy reaches it) and returns its output and exit code.
func shIn(t *testing.T, sb *sandbox.Record, script string) (string, int32) {
	t.Helper()
	return shInWith(t, sb, &http.Client{Transport: &http.Transport{Proxy: nil}}, script)
}

// shInWith is shIn through client hc.
func shInWith(t *testing.T, sb *sandbox.Record, hc *http.Client, script string) (string, int32) {
	t.Helper()
	defer hc.CloseIdleConnections()
	c := processconnect.NewProcessClient(hc, fmt.Sprintf("http://%s:%d", sb.Network.HostIP, agentproto.Port))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := c.Start(ctx, connect.NewRequest(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", script}}}))
	if err != nil {
		t.Fatalf("start %q: %v", script, err)
	}
	defer s.Close()
	var out strings.Builder
	for s.Receive() {
		ev := s.Msg().GetEvent()
		if d := ev.GetData(); d != nil {
			out.Write(d.GetStdout())
			out.Write(d.GetStderr())
		}
		if e := ev.GetEnd(); e != nil {
			return out.String(), e.GetExitCode()
		}
	}
	t.Fatalf("%q: stream ended without an exit: %v (output %q)", script, s.Err(), out.String())
	return "", 0
}

// TestNetworkDNS: a sandbox in a slot — runc and gVisor — gets a
// resolv.conf naming the node's DNS forwarder and resolves through it
// with its own resolver library (busybox nslookup and nc, by name); a
// domain policy opens the resolved address only and refuses other names
// at DNS; an update to the default policy opens both (the control).
func TestNetworkDNS(t *testing.T) {
	env := cubelettest.New(t, "[gvisor]\ncheckpoint = false\n")
	w := nettest.NewWorld(t)
	allowed, other := w.Addrs[1], w.Addrs[2]
	up := w.ServeDNS(t, map[string][]netip.Addr{"api.allowed.test": {allowed}, "other.test": {other}})
	env.StartNetworkAgent(t, nettest.Options{DNSUpstreams: []string{up.String()}})
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()
	no := false

	for _, rt := range []string{"runc", "gvisor"} {
		t.Run(rt, func(t *testing.T) {
			if rt == "gvisor" {
				testenv.RequireBinary(t, "runsc", "runsc")
			}
			res, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox", Runtime: rt,
				Network: netPolicy(t, policy.Spec{AllowInternet: &no, Allow: []string{"api.allowed.test"}})})
			if err != nil {
				t.Fatalf("create: %v", err)
			}
			a := res.Sandbox
			cleanupDelete(t, svc, a.ID)
			if a.Network.Resolver != network.SandboxGateway.String() {
				t.Fatalf("record's resolver %q", a.Network.Resolver)
			}
			out, code := shIn(t, a, "cat /etc/resolv.conf")
			if code != 0 || !strings.Contains(out, "\nnameserver 169.254.0.22\n") {
				t.Fatalf("sandbox's /etc/resolv.conf (exit %d): %q", code, out)
			}
			// By name, through the sandbox's own resolver configuration.
			connect := func(host string) (string, int32) {
				return shIn(t, a, fmt.Sprintf("echo ping | nc -w 2 %s %d", host, w.Port))
			}
			out, code = connect("api.allowed.test")
			t.Logf("nc api.allowed.test (allowed name): exit %d %q", code, out)
			if code != 0 || !strings.Contains(out, "hello") {
				t.Fatalf("allowed name unreachable by name: exit %d %q", code, out)
			}
			out, code = shIn(t, a, "nslookup other.test")
			t.Logf("nslookup other.test (outside the policy): exit %d %q", code, out)
			if code == 0 || strings.Contains(out, other.String()) {
				t.Fatalf("a name outside the policy resolved: %q", out)
			}
			out, code = connect(other.String())
			t.Logf("nc %s (never resolved): exit %d %q", other, code, out)
			if code == 0 && strings.Contains(out, "hello") {
				t.Fatalf("an address the sandbox never resolved answered: %q", out)
			}
			if rt == "runc" {
				// The forwarder itself, queried from the sandbox's
				// namespace: REFUSED, not a timeout.
				ans, err := nettest.Resolve(ctx, fmt.Sprintf("/proc/%d/ns/net", a.Container.PID),
					netip.AddrPortFrom(network.SandboxGateway, 53), "udp", "other.test", 5*time.Second)
				if err != nil || ans.Rcode != dns.RcodeRefused {
					t.Fatalf("other.test from the runc sandbox's namespace: %s %v", ans, err)
				}
			}
			// Control: the default policy answers both.
			if _, err := svc.UpdateNetwork(ctx, a.ID, policy.Policy{}); err != nil {
				t.Fatal(err)
			}
			out, code = shIn(t, a, "nslookup other.test")
			if code != 0 || !strings.Contains(out, other.String()) {
				t.Fatalf("default policy: nslookup other.test exit %d %q", code, out)
			}
			out, code = connect("other.test")
			if code != 0 || !strings.Contains(out, "hello") {
				t.Fatalf("default policy: other.test by name: exit %d %q", code, out)
			}
			t.Logf("default policy: other.test resolves and answers")
		})
	}
}

// TestVMDNS: a micro-VM gets the resolver on its kernel command line and
// cube-agent writes it into the guest's /etc/resolv.conf; the guest
// resolves through the forwarder bound on its slot's TAP.
func TestVMDNS(t *testing.T) {
	cubelettest.RequireRoot(t)
	testenv.RequireBinary(t, "qemu-system-x86_64", "qemu-system-x86")
	bctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	dir := filepath.Join(vmguest.DefaultCacheDir, "guest-cubelet")
	if _, err := vmguest.Build(bctx, vmguest.BuildConfig{OutDir: dir}); err != nil {
		t.Fatalf("guest artifacts: %v", err)
	}
	accel := os.Getenv("CUBE_VM_ACCEL")
	if accel == "" {
		accel = "tcg"
	}
	env := cubelettest.New(t, fmt.Sprintf("[vm]\nguest_dir = %q\naccel = %q\n[sandbox]\nagent_ready_timeout = \"120s\"\n", dir, accel))
	w := nettest.NewWorld(t)
	allowed, other := w.Addrs[1], w.Addrs[2]
	up := w.ServeDNS(t, map[string][]netip.Addr{"api.allowed.test": {allowed}, "other.test": {other}})
	agent := env.StartNetworkAgent(t, nettest.Options{DNSUpstreams: []string{up.String()}})
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()
	no := false

	res, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox", Runtime: "vm",
		Network: netPolicy(t, policy.Spec{AllowInternet: &no, Allow: []string{"api.allowed.test"}})})
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	a := res.Sandbox
	cleanupDelete(t, svc, a.ID)
	out, code := shIn(t, a, "cat /etc/resolv.conf; cat /proc/cmdline")
	if code != 0 || !strings.Contains(out, "\nnameserver 169.254.0.22\n") || !strings.Contains(out, "cube.resolver=169.254.0.22") {
		t.Fatalf("guest resolv.conf / cmdline (exit %d): %q", code, out)
	}
	// The node's egress CA crossed the kernel command line into the
	// guest's trust store, which the guest's processes are pointed at.
	out, code = shIn(t, a, "cat $SSL_CERT_FILE")
	if code != 0 || !strings.Contains(out, strings.TrimSpace(string(agent.Agent.EgressCA()))) {
		t.Fatalf("VM: SSL_CERT_FILE lacks the egress CA (exit %d): %q", code, out)
	}
	out, code = shIn(t, a, fmt.Sprintf("echo ping | nc -w 5 api.allowed.test %d", w.Port))
	t.Logf("VM: nc api.allowed.test: exit %d %q", code, out)
	if code != 0 || !strings.Contains(out, "hello") {
		t.Fatalf("VM: allowed name unreachable by name: exit %d %q", code, out)
	}
	out, code = shIn(t, a, "nslookup other.test")
	t.Logf("VM: nslookup other.test: exit %d %q", code, out)
	if code == 0 || !strings.Contains(out, "REFUSED") {
		t.Fatalf("VM: a name outside the policy: exit %d %q", code, out)
	}
	if _, err := svc.UpdateNetwork(ctx, a.ID, policy.Policy{}); err != nil {
		t.Fatal(err)
	}
	out, code = shIn(t, a, "nslookup other.test")
	if code != 0 || !strings.Contains(out, other.String()) {
		t.Fatalf("VM, default policy (control): nslookup other.test exit %d %q", code, out)
	}
}
