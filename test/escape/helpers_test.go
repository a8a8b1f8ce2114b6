package escape

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	pb "github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/network/netnsdir"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/testimage"
)

// ProbePath is where the test template carries the probe.
const ProbePath = "/usr/local/bin/probe"

// buildProbe builds ./probe statically into dir.
func buildProbe(t *testing.T, dir string) string {
	t.Helper()
	out := filepath.Join(dir, "probe")
	cmd := exec.Command("go", "build", "-trimpath", "-o", out, "./test/escape/probe")
	cmd.Dir = cubelettest.RepoRoot()
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build probe: %v\n%s", err, b)
	}
	return out
}

// probeImage writes an OCI layout of the busybox test image plus a layer
// holding the probe at ProbePath, and returns its directory.
func probeImage(t *testing.T, probe, dir string) string {
	t.Helper()
	bin, err := os.ReadFile(probe)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, d := range []string{"usr/", "usr/local/", "usr/local/bin/"} {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d, Mode: 0o755, Format: tar.FormatPAX}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: strings.TrimPrefix(ProbePath, "/"), Mode: 0o755, Size: int64(len(bin)), Format: tar.FormatPAX}); err != nil {
		t.Fatal(err)
	}
	if _, err := tw.Write(bin); err != nil {
		t.Fatal(err)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	data := buf.Bytes()
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil })
	if err != nil {
		t.Fatal(err)
	}
	base, err := testimage.BusyboxImage()
	if err != nil {
		t.Fatal(err)
	}
	img, err := mutate.AppendLayers(base, layer)
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "probe-oci")
	p, err := layout.Write(out, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.AppendImage(img); err != nil {
		t.Fatal(err)
	}
	return out
}

// execResult is one process run through a sandbox's agent.
type execResult struct {
	Stdout, Stderr string
	Exit           int
	Status         string // the agent's end status ("exit status 0", "signal: killed")
}

// agentExec runs args through the envd process API of the sandbox's agent
// (its slot address) as root; onLine sees each stdout line as it comes.
func agentExec(ctx context.Context, sb *sandbox.Record, timeout time.Duration, onLine func(string), args ...string) (execResult, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	hc := &http.Client{Transport: &http.Transport{Proxy: nil}}
	defer hc.CloseIdleConnections()
	base := fmt.Sprintf("http://%s:%d", sb.Network.HostIP, agentproto.Port)
	req := connect.NewRequest(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: args[0], Args: args[1:]}})
	req.Header().Set("Authorization", "Basic cm9vdDo=") // root:
	s, err := processconnect.NewProcessClient(hc, base).Start(ctx, req)
	if err != nil {
		return execResult{}, err
	}
	defer s.Close()
	var r execResult
	var out, errb []byte
	var end *pb.ProcessEvent_EndEvent
	partial := ""
	for s.Receive() {
		ev := s.Msg().GetEvent()
		if d := ev.GetData().GetStdout(); len(d) > 0 {
			out = append(out, d...)
			if onLine != nil {
				partial += string(d)
				for {
					line, rest, ok := strings.Cut(partial, "\n")
					if !ok {
						break
					}
					onLine(line)
					partial = rest
				}
			}
		}
		errb = append(errb, ev.GetData().GetStderr()...)
		if e := ev.GetEnd(); e != nil {
			end = e
		}
	}
	r.Stdout, r.Stderr = string(out), string(errb)
	if err := s.Err(); err != nil {
		return r, err
	}
	if end == nil {
		return r, fmt.Errorf("no end event")
	}
	r.Exit, r.Status = int(end.GetExitCode()), end.GetStatus()
	return r, nil
}

// lines parses probe output: row -> (word, detail).
type line struct{ Word, Detail string }

func parseLines(out string) map[string]line {
	m := map[string]line{}
	for _, l := range strings.Split(out, "\n") {
		f := strings.SplitN(l, "\t", 3)
		if len(f) == 3 {
			m[f[0]] = line{f[1], f[2]}
		}
	}
	return m
}

// hostProbe runs the probe on the host (the controls); attr may set
// credentials or namespaces.
func hostProbe(probe string, attr *syscall.SysProcAttr, args ...string) (string, error) {
	cmd := exec.Command(probe, args...)
	cmd.SysProcAttr = attr
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// udpEcho answers every datagram to addr:port for each of addrs in the
// namespace nsPath ("" = the host) with "echo <payload>", from the address
// it was sent to (a wildcard socket would answer from the route's source,
// which a connected client ignores); it stops on cleanup.
func udpEcho(t *testing.T, nsPath string, addrs []netip.Addr, port int) {
	t.Helper()
	for _, a := range addrs {
		var pc net.PacketConn
		listen := func() (err error) {
			pc, err = net.ListenPacket("udp4", netip.AddrPortFrom(a, uint16(port)).String())
			return err
		}
		var err error
		if nsPath == "" {
			err = listen()
		} else {
			err = netnsdir.Do(nsPath, listen)
		}
		if err != nil {
			t.Fatalf("udp echo on %s in %q: %v", a, nsPath, err)
		}
		done := make(chan struct{})
		t.Cleanup(func() { pc.Close(); <-done })
		go func() {
			defer close(done)
			buf := make([]byte, 2048)
			for {
				n, from, err := pc.ReadFrom(buf)
				if err != nil {
					return
				}
				_, _ = pc.WriteTo(append([]byte("echo "), buf[:n]...), from)
			}
		}()
	}
}

// rawCapture collects the payloads of TCP, UDP and ICMP packets that
// reach the namespace (raw sockets see every packet of their protocol
// before the protocol handler does, so a forged SYN counts even though
// nothing answers it).
type rawCapture struct {
	mu   sync.Mutex
	seen []string
}

func newRawCapture(t *testing.T, nsPath string) *rawCapture {
	t.Helper()
	c := &rawCapture{}
	var fds []int
	err := netnsdir.Do(nsPath, func() error {
		for _, p := range []int{syscall.IPPROTO_TCP, syscall.IPPROTO_UDP, syscall.IPPROTO_ICMP} {
			fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_RAW, p)
			if err != nil {
				return err
			}
			fds = append(fds, fd)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("raw capture: %v", err)
	}
	var wg sync.WaitGroup
	stop := make(chan struct{})
	t.Cleanup(func() {
		close(stop)
		wg.Wait()
		for _, fd := range fds {
			syscall.Close(fd)
		}
	})
	for _, fd := range fds {
		tv := syscall.NsecToTimeval(int64(200 * time.Millisecond))
		if err := syscall.SetsockoptTimeval(fd, syscall.SOL_SOCKET, syscall.SO_RCVTIMEO, &tv); err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, 65536)
			for {
				select {
				case <-stop:
					return
				default:
				}
				n, _, err := syscall.Recvfrom(fd, buf, 0)
				if err != nil || n < 20 {
					continue
				}
				c.mu.Lock()
				c.seen = append(c.seen, string(buf[:n]))
				if len(c.seen) > 4096 {
					c.seen = c.seen[2048:]
				}
				c.mu.Unlock()
			}
		}()
	}
	return c
}

// arrived reports which of the nonce's per-protocol payloads arrived
// within d, with the source address each carried.
func (c *rawCapture) arrived(nonce string, d time.Duration) map[string]string {
	got := map[string]string{}
	deadline := time.Now().Add(d)
	for {
		c.mu.Lock()
		for _, p := range c.seen {
			for _, proto := range []string{"tcp", "udp", "icmp"} {
				if strings.Contains(p, nonce+"-"+proto) {
					got[proto] = net.IP([]byte(p[12:16])).String()
				}
			}
		}
		c.mu.Unlock()
		if len(got) == 3 || time.Now().After(deadline) {
			return got
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// cgroupFile reads a file of the sandbox's cgroup in the v1 hierarchy of
// controller, or the unified one.
func cgroupFile(cgroupPath, controller, file string) (string, error) {
	for _, root := range []string{filepath.Join("/sys/fs/cgroup", controller), "/sys/fs/cgroup", "/sys/fs/cgroup/unified"} {
		b, err := os.ReadFile(filepath.Join(root, cgroupPath, file))
		if err == nil {
			return strings.TrimSpace(string(b)), nil
		}
	}
	return "", fmt.Errorf("%s/%s of %s not found", controller, file, cgroupPath)
}

// field returns the value of key in a "key value" file (memory.stat,
// pids.events, memory.oom_control).
func field(content, key string) int64 {
	sc := bufio.NewScanner(strings.NewReader(content))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 2 && f[0] == key {
			n, _ := strconv.ParseInt(f[1], 10, 64)
			return n
		}
	}
	return -1
}
