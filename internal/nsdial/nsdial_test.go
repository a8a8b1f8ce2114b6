package nsdial

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/testenv"
	"golang.org/x/sys/unix"
)

// newNetns creates a network namespace with loopback up, listens on
// 127.0.0.1 inside it, and returns the bind-mounted netns file and the
// listener. The creating thread switches back to its own netns afterwards;
// it is unlocked only if that worked (a locked thread dies with its
// goroutine, except the main thread, which Go parks forever).
func newNetns(t *testing.T) (string, net.Listener) {
	t.Helper()
	testenv.RequireRoot(t, "creates a network namespace")
	path := filepath.Join(t.TempDir(), "netns")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	type result struct {
		ln  net.Listener
		err error
	}
	res := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := os.Open(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()))
		if err != nil {
			res <- result{nil, err}
			return
		}
		defer orig.Close()
		ln, err := func() (net.Listener, error) {
			if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
				return nil, fmt.Errorf("unshare: %w", err)
			}
			self := fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid())
			if err := unix.Mount(self, path, "", unix.MS_BIND, ""); err != nil {
				return nil, fmt.Errorf("bind netns: %w", err)
			}
			if err := loopbackUp(); err != nil {
				return nil, err
			}
			return net.Listen("tcp", "127.0.0.1:0")
		}()
		if rerr := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); rerr != nil {
			res <- result{ln, fmt.Errorf("restore netns: %w", rerr)}
			return
		}
		runtime.UnlockOSThread()
		res <- result{ln, err}
	}()
	r := <-res
	t.Cleanup(func() {
		if err := unix.Unmount(path, unix.MNT_DETACH); err != nil && err != unix.EINVAL {
			t.Errorf("unmount netns: %v", err)
		}
	})
	if r.err != nil {
		t.Fatal(r.err)
	}
	t.Cleanup(func() { r.ln.Close() })
	return path, r.ln
}

func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("get lo flags: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("set lo up: %w", err)
	}
	return nil
}

func netnsOf(t *testing.T, path string) string {
	t.Helper()
	l, err := os.Readlink(path)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func TestHTTPClientReachesServerInNetns(t *testing.T) {
	hostNS := netnsOf(t, "/proc/thread-self/ns/net")
	path, ln := newNetns(t)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusNoContent)
	})}
	go func() { _ = srv.Serve(ln) }() // ErrServerClosed at cleanup
	t.Cleanup(func() { srv.Close() })

	url := "http://" + ln.Addr().String() + "/health"
	c := HTTPClient(path)
	c.Timeout = 5 * time.Second
	for range 20 {
		resp, err := c.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusNoContent {
			t.Fatalf("status %d", resp.StatusCode)
		}
		c.CloseIdleConnections() // force a fresh dial each round
	}

	// The listener is only in the namespace: from the host it must fail.
	d := net.Dialer{Timeout: time.Second}
	if conn, err := d.Dial("tcp", ln.Addr().String()); err == nil {
		conn.Close()
		t.Fatalf("reached %s from the host netns", ln.Addr())
	}

	// No thread of this process may have been left in the sandbox netns.
	tasks, _ := filepath.Glob("/proc/self/task/*/ns/net")
	for _, task := range tasks {
		if l, err := os.Readlink(task); err == nil && l != hostNS {
			t.Errorf("%s is in %s, want host %s", task, l, hostNS)
		}
	}
}

func TestDialContextErrors(t *testing.T) {
	ctx := context.Background()
	if _, err := DialContext(ctx, "/proc/self/ns/net", "tcp", "localhost:1"); err == nil {
		t.Error("hostname accepted")
	}
	if _, err := DialContext(ctx, "/nonexistent/netns", "tcp", "127.0.0.1:1"); err == nil {
		t.Error("missing netns accepted")
	}
	if os.Geteuid() != 0 {
		return
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := DialContext(cctx, "/proc/self/ns/net", "tcp", "127.0.0.1:1"); err == nil {
		t.Error("cancelled ctx dialed")
	}
}
