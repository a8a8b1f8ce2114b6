package launcher_test

import (
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/launcher"
	"github.com/cubesandbox/cube/internal/network/netnsdir"
)

// listener is a listening socket of a process: "tcp 127.0.0.1:3000" or
// "unix /run/cube/cubelet.sock".
type listener struct {
	pid  int
	name string // the daemon (its comm)
	addr string
}

// daemons are the processes `cube up` started: children of this test
// process (launcher.Up runs in it) named after a daemon.
func daemons(t *testing.T) map[int]string {
	t.Helper()
	out := map[int]string{}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...
		s := string(stat)
		i := strings.LastIndexByte(s, ')')
		if i < 0 {
			continue
		}
		comm := s[strings.IndexByte(s, '(')+1 : i]
		f := strings.Fields(s[i+1:])
		if len(f) < 2 {
			continue
		}
		if ppid, _ := strconv.Atoi(f[1]); ppid == os.Getpid() && slices.Contains([]string{"cubemaster", "cubelet", "network-agent"}, comm) {
			out[pid] = comm
		}
	}
	return out
}

// socketInodes are the socket inodes pid holds open.
func socketInodes(t *testing.T, pid int) map[string]bool {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	for _, e := range ents {
		l, err := os.Readlink(filepath.Join(dir, e.Name()))
		if err == nil && strings.HasPrefix(l, "socket:[") {
			out[strings.TrimSuffix(strings.TrimPrefix(l, "socket:["), "]")] = true
		}
	}
	return out
}

// listening reads /proc/net/{tcp,tcp6,udp,udp6,unix}: every listening
// socket of the host's network namespace by inode (a bound, unconnected
// UDP socket counts: it is how a UDP server listens).
func listening(t *testing.T) map[string]string {
	t.Helper()
	out, err := readListening("/proc/net", "")
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile("/proc/net/unix")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n")[1:] {
		fs := strings.Fields(line)
		// Flags __SO_ACCEPTCON: a listening socket.
		if len(fs) >= 7 && fs[3] == "00010000" {
			path := ""
			if len(fs) >= 8 {
				path = fs[7]
			}
			out[fs[6]] = "unix " + path
		}
	}
	return out
}

// readListening reads the TCP and UDP tables under dir (a network
// namespace's /proc/.../net): listening TCP sockets and bound, unconnected
// UDP ones, by inode, named "tcp ADDR" / "udp ADDR" plus suffix.
func readListening(dir, suffix string) (map[string]string, error) {
	out := map[string]string{}
	for _, f := range []string{"tcp", "tcp6", "udp", "udp6"} {
		b, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			return nil, err
		}
		listen := "0A" // TCP_LISTEN
		if strings.HasPrefix(f, "udp") {
			listen = "07" // TCP_CLOSE: not connected
		}
		for _, line := range strings.Split(string(b), "\n")[1:] {
			fs := strings.Fields(line)
			if len(fs) < 10 || fs[3] != listen || fs[9] == "0" {
				continue
			}
			a, err := decodeHexAddr(fs[1])
			if err != nil {
				return nil, err
			}
			out[fs[9]] = strings.TrimSuffix(f, "6") + " " + a + suffix
		}
	}
	return out, nil
}

// pinnedListening is every listening socket of every pinned network
// namespace other than the host's (slot and sandbox namespaces: their
// pins are nsfs bind mounts), by inode, named with the namespace's pin
// ("udp 169.254.0.22:53 in <pin>").
func pinnedListening(t *testing.T) map[string]string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	host, err := os.Readlink("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	seen := map[string]bool{host: true}
	for _, line := range strings.Split(string(b), "\n") {
		// id parent maj:min root mountpoint opts ... - fstype source opts
		pre, post, ok := strings.Cut(line, " - ")
		fs, ps := strings.Fields(pre), strings.Fields(post)
		if !ok || len(fs) < 5 || len(ps) < 1 || ps[0] != "nsfs" || !strings.HasPrefix(fs[3], "net:[") {
			continue
		}
		if seen[fs[3]] {
			continue
		}
		seen[fs[3]] = true
		pin := fs[4]
		err := netnsdir.Do(pin, func() error {
			m, err := readListening("/proc/thread-self/net", " in "+pin)
			maps.Copy(out, m)
			return err
		})
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			t.Logf("network namespace %s: %v", pin, err)
		}
	}
	return out
}

// decodeHexAddr decodes /proc/net/tcp's "0100007F:0BB8" (host byte order
// words).
func decodeHexAddr(s string) (string, error) {
	h, p, _ := strings.Cut(s, ":")
	raw, err := hex.DecodeString(h)
	if err != nil {
		return "", err
	}
	for i := 0; i+4 <= len(raw); i += 4 { // each 32-bit word is little-endian
		raw[i], raw[i+1], raw[i+2], raw[i+3] = raw[i+3], raw[i+2], raw[i+1], raw[i]
	}
	ip, _ := netip.AddrFromSlice(raw)
	port, _ := strconv.ParseUint(p, 16, 16)
	return netip.AddrPortFrom(ip.Unmap(), uint16(port)).String(), nil
}

// checkListeners is the listener inventory of a running `cube up`, read
// from the kernel (/proc/<pid>/fd and /proc/net): every listening socket
// of every daemon must be one the configuration names, each TCP one on
// loopback, each unix one mode 0600, and each refuses a caller without a
// credential (the TLS and token probes are in checkTLS and TestUp). An
// unknown listener fails the test.
func checkListeners(t *testing.T, cfg launcher.Config, nodeAPI, cubeletTCP string) {
	t.Helper()
	want := map[string]string{
		"tcp " + cfg.APIAddr:   "cubemaster",
		"tcp " + cfg.ProxyAddr: "cubemaster",
		"tcp " + nodeAPI:       "cubemaster",
		"unix " + filepath.Join(cfg.RunDir, "cubemaster.sock"): "cubemaster",
		"tcp " + cubeletTCP: "cubelet",
		"unix " + filepath.Join(cfg.RunDir, "cubelet.sock"): "cubelet",
	}
	var found []listener
	deadline := time.Now().Add(10 * time.Second)
	for {
		procs := daemons(t)
		socks := listening(t)
		found = found[:0]
		for pid, name := range procs {
			for ino := range socketInodes(t, pid) {
				if a, ok := socks[ino]; ok {
					found = append(found, listener{pid: pid, name: name, addr: a})
				}
			}
		}
		if len(found) >= len(want) || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	seen := map[string]bool{}
	for _, l := range found {
		seen[l.addr] = true
		owner, ok := want[l.addr]
		if !ok || owner != l.name {
			t.Errorf("%s (pid %d) listens on %s, which is not in the inventory (docs/security.md, Listeners)", l.name, l.pid, l.addr)
			continue
		}
		kind, addr, _ := strings.Cut(l.addr, " ")
		switch kind {
		case "tcp":
			ap, err := netip.ParseAddrPort(addr)
			if err != nil || !ap.Addr().IsLoopback() {
				t.Errorf("%s listens on %s, beyond loopback", l.name, addr)
			}
		case "unix":
			fi, err := os.Stat(addr)
			if err != nil || fi.Mode().Perm() != 0o600 {
				t.Errorf("%s's socket %s: %v, %v: want mode 0600", l.name, addr, fi, err)
			}
		}
		t.Logf("%s (pid %d): %s", l.name, l.pid, l.addr)
	}
	for a, owner := range want {
		if !seen[a] {
			t.Errorf("%s does not listen on %s", owner, a)
		}
	}
	// No credential: the E2B API answers 401 on a sandbox route, the route
	// does not serve /metrics (nor a sandbox that does not exist).
	for _, c := range []struct {
		url, host string
		want      int
	}{
		{"http://" + cfg.APIAddr + "/v2/sandboxes", "", http.StatusUnauthorized},
		{"http://" + cfg.ProxyAddr + "/metrics", "", http.StatusBadRequest},
		{"http://" + cfg.ProxyAddr + "/", "49983-nosuchsandbox00000.localhost", http.StatusBadGateway},
	} {
		req, _ := http.NewRequest("GET", c.url, nil)
		if c.host != "" {
			req.Host = c.host
		}
		resp, err := (&http.Client{Timeout: 5 * time.Second}).Do(req)
		if err != nil {
			t.Errorf("GET %s: %v", c.url, err)
			continue
		}
		resp.Body.Close()
		if resp.StatusCode != c.want {
			t.Errorf("GET %s (host %q) without a credential: %d, want %d", c.url, c.host, resp.StatusCode, c.want)
		}
	}
}
