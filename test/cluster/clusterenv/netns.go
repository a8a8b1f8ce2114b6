package clusterenv

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/forkthread"
)

// Host is one machine of the cluster: a network namespace with one
// interface (eth0) on the cluster's bridge and an address of its own.
type Host struct {
	Name string // db, m1, p1, n1, ...
	NS   string // the namespace's name (/run/netns/<NS>)
	IP   string
	veth string // the bridge end, in the test's namespace
	// bridge is the cluster's bridge; unplugged: Unplug cut the host off.
	bridge    string
	unplugged bool
}

// nsPath is the namespace's bind mount.
func (h *Host) nsPath() string { return "/run/netns/" + h.NS }

func ip(args ...string) error {
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		return fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

// addHost makes a host's namespace and plugs it into the bridge. Its
// cleanup (run after the processes', registered earlier) deletes both.
func (c *Cluster) addHost(t testing.TB, name string, n int) *Host {
	t.Helper()
	h := &Host{Name: name, NS: fmt.Sprintf("cube-cl-%s-%s", c.ID, name), IP: fmt.Sprintf("%s.%d", c.net, 10+n),
		veth: fmt.Sprintf("ccl%s%02d", c.ID, n)}
	if err := ip("netns", "add", h.NS); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = ip("link", "del", h.veth)
		if err := ip("netns", "del", h.NS); err != nil {
			t.Errorf("delete host %s: %v", name, err)
		}
	})
	h.bridge = c.Bridge
	if err := h.Plug(); err != nil {
		t.Fatal(err)
	}
	return h
}

// Plug connects the host to the bridge: a veth pair, eth0 with the
// host's address on its side.
func (h *Host) Plug() error {
	for _, args := range [][]string{
		{"link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.NS},
		{"link", "set", h.veth, "master", h.bridge, "up"},
		{"-n", h.NS, "link", "set", "lo", "up"},
		{"-n", h.NS, "addr", "add", h.IP + "/24", "dev", "eth0"},
		{"-n", h.NS, "link", "set", "eth0", "up"},
	} {
		if err := ip(args...); err != nil {
			return err
		}
	}
	h.unplugged = false
	return nil
}

// Unplug cuts the host off the network (its cable pulled): the bridge end
// of its link is deleted, which deletes the host's end too.
func (h *Host) Unplug() error {
	h.unplugged = true
	return ip("link", "del", h.veth)
}

// Proc is a daemon running in a host's namespace.
type Proc struct {
	Name string
	cmd  *exec.Cmd
	done chan struct{}
	out  lockedBuffer
	err  error
}

// start runs bin with args in h's network namespace (nsenter execs the
// binary: the process is ours, and dies with the test process). Its
// output goes to the test's log (prefixed) and to Output.
func (h *Host) start(t testing.TB, name, bin string, args ...string) *Proc {
	t.Helper()
	p := &Proc{Name: name, done: make(chan struct{})}
	p.cmd = exec.Command("nsenter", append([]string{"--net=" + h.nsPath(), "--", bin}, args...)...)
	w := io.MultiWriter(&p.out, prefixWriter{t: t, prefix: name + ": "})
	p.cmd.Stdout, p.cmd.Stderr = w, w
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := forkthread.Start(p.cmd); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	go func() { p.err = p.cmd.Wait(); close(p.done) }()
	return p
}

// Running says whether the process has not exited.
func (p *Proc) Running() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// Kill SIGKILLs the process (and its group) and waits for it.
func (p *Proc) Kill() {
	if p.Running() {
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	}
	<-p.done
}

// Stop sends SIGTERM and waits up to d, then kills.
func (p *Proc) Stop(d time.Duration) {
	if !p.Running() {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(d):
		p.Kill()
	}
}

// Output is everything the process wrote.
func (p *Proc) Output() string { return p.out.String() }

type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// prefixWriter logs each write to t with a prefix; quiet after the test
// ended (a daemon's last lines at cleanup would panic t.Log otherwise).
type prefixWriter struct {
	t      testing.TB
	prefix string
}

var logMu sync.Mutex

func (w prefixWriter) Write(p []byte) (int, error) {
	if os.Getenv("CUBE_CLUSTER_QUIET") != "" {
		return len(p), nil
	}
	logMu.Lock()
	defer logMu.Unlock()
	defer func() { _ = recover() }()
	for _, l := range strings.Split(strings.TrimRight(string(p), "\n"), "\n") {
		w.t.Log(w.prefix + l)
	}
	return len(p), nil
}
