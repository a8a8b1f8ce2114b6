// Command probe is the escape suite's attempt runner: a static binary the
// suite puts into its test template and runs inside a sandbox of every
// runtime (and, for the controls, on the host). Each attempt prints one
// line:
//
//	<row>\t<escaped|blocked|sent>\t<what happened>
//
// "escaped" means the attempt did what an attacker wants (the syscall
// worked, the write landed, an answer came back); "blocked" carries the
// error that stopped it; "sent" means packets left the probe and only a
// capture outside can tell whether they arrived. The suite decides what
// each outcome means for each runtime; the probe only reports.
//
// Usage:
//
//	probe rows [flags] ROW...   run attempts (flags below)
//	probe net TARGET...         reach targets: name=tcp|udp|icmp:ADDR:PORT
//	probe forkbomb N            start up to N processes, report how many
//	probe membomb MIB           allocate and touch MIB MiB
//	probe fill PATH             write PATH until the disk is full
//	probe inotify MAX SECONDS   hold up to MAX inotify instances
//	probe swap DIR TARGET       move DIR aside, put a symlink to TARGET there
//	probe euid                  print the effective uid (setuid check)
//	probe hold MARKER           sleep (a ptrace target with MARKER in argv)
package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: probe rows|net|forkbomb|membomb|fill|inotify|euid|hold ...")
		os.Exit(2)
	}
	args := os.Args[2:]
	switch os.Args[1] {
	case "rows":
		rows(args)
	case "net":
		netRows(args)
	case "egress":
		egressRows(args)
	case "forkbomb":
		forkbomb(atoi(args, 0))
	case "membomb":
		membomb(atoi(args, 0))
	case "fill":
		fill(args[0])
	case "inotify":
		inotifyHold(atoi(args, 0), atoi(args, 1))
	case "euid":
		fmt.Println(os.Geteuid())
	case "swap":
		swap(args[0], args[1])
	case "hold":
		time.Sleep(time.Hour)
	case "netadmin":
		netadmin()
	case "sleep":
		time.Sleep(time.Duration(atoi(args, 0)) * time.Second)
	default:
		fmt.Fprintln(os.Stderr, "unknown command", os.Args[1])
		os.Exit(2)
	}
}

func atoi(args []string, i int) int {
	if i >= len(args) {
		fmt.Fprintln(os.Stderr, "missing argument")
		os.Exit(2)
	}
	n, err := strconv.Atoi(args[i])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	return n
}

func report(row string, escaped bool, format string, a ...any) {
	word := "blocked"
	if escaped {
		word = "escaped"
	}
	fmt.Printf("%s\t%s\t%s\n", row, word, strings.ReplaceAll(fmt.Sprintf(format, a...), "\n", " | "))
}

// opts are the rows' parameters (set by the suite).
type opts struct {
	hostKeyring      int
	marker           string
	hostPID          int
	world            string
	port             int
	nonce            string
	spoofSrc         string
	plant            string
	agentPath        string
	procSys, sysFile string
	fdPID            int
}

func rows(args []string) {
	var o opts
	fs := flag.NewFlagSet("rows", flag.ExitOnError)
	fs.IntVar(&o.hostKeyring, "host-keyring", 0, "the host root's user keyring serial")
	fs.StringVar(&o.marker, "marker", "", "argv marker of a host process to find")
	fs.IntVar(&o.hostPID, "host-pid", 0, "host pid of that process")
	fs.StringVar(&o.world, "world", "", "world address for raw packets")
	fs.IntVar(&o.port, "port", 0, "world port")
	fs.StringVar(&o.nonce, "nonce", "", "payload marker of raw packets")
	fs.StringVar(&o.spoofSrc, "spoof-src", "198.51.100.2", "forged source address (no test world holds it: nettest.ForgedSource)")
	fs.StringVar(&o.plant, "plant", "/escape-suid", "where to plant a setuid copy of the probe (on the root filesystem: /tmp may be the runtime's own tmpfs)")
	fs.StringVar(&o.agentPath, "agent", "/usr/local/bin/cube-agent", "the agent binary")
	fs.StringVar(&o.procSys, "proc-sys", "/proc/sys/kernel/printk_ratelimit", "a host-wide sysctl")
	fs.StringVar(&o.sysFile, "sys", "/sys/kernel/mm/ksm/run", "a host-wide sysfs attribute")
	fs.IntVar(&o.fdPID, "fd-pid", 1, "whose stdout proc1-fd1 writes to")
	_ = fs.Parse(args)
	for _, r := range fs.Args() {
		switch r {
		case "userns":
			userns()
		case "keyctl":
			keyctl(o.hostKeyring)
		case "mount":
			mountTmpfs()
		case "bpf":
			bpf()
		case "ptrace-host":
			ptraceHost(o.marker, o.hostPID)
		case "ptrace-agent":
			ptraceAgent()
		case "proc1-fd1":
			proc1fd1(o.fdPID)
		case "proc-sys":
			writeSame("proc-sys", o.procSys)
		case "sys":
			writeSame("sys", o.sysFile)
		case "agent-binary":
			agentBinary(o.agentPath)
		case "raw-spoof":
			rawSpoof(o)
		case "plant-setuid":
			plantSetuid(o.plant)
		case "mknod":
			mknod(filepath.Dir(o.plant))
		case "ipv6":
			ipv6()
		case "ro-bind":
			create("ro-bind", "/ro/escape")
		case "ro-submount":
			create("ro-submount", "/ro/sub/escape")
		default:
			fmt.Printf("%s\tblocked\tunknown row\n", r)
		}
	}
}

// userns: a new user namespace with a network namespace gives
// CAP_NET_ADMIN over a fresh netns, the entry to nf_tables bugs. The
// child proves the capability by bringing its loopback up.
func userns() {
	cmd := exec.Command("/proc/self/exe", "netadmin")
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  syscall.CLONE_NEWUSER | syscall.CLONE_NEWNET,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getuid(), Size: 1}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getgid(), Size: 1}},
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		report("userns", false, "clone(CLONE_NEWUSER|CLONE_NEWNET): %v %s", err, bytes.TrimSpace(out))
		return
	}
	report("userns", true, "clone(CLONE_NEWUSER|CLONE_NEWNET) worked: %s", bytes.TrimSpace(out))
}

func netadmin() {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM, 0)
	if err != nil {
		fmt.Println("socket:", err)
		os.Exit(1)
	}
	ifr, _ := unix.NewIfreq("lo")
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		fmt.Println("SIOCGIFFLAGS:", err)
		os.Exit(1)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		fmt.Println("SIOCSIFFLAGS lo up:", err)
		os.Exit(1)
	}
	fmt.Println("CAP_NET_ADMIN in the new netns (lo set up)")
}

func keyctl(hostKeyring int) {
	id, err := unix.KeyctlInt(unix.KEYCTL_GET_KEYRING_ID, unix.KEY_SPEC_USER_KEYRING, 0, 0, 0)
	if err != nil {
		report("keyctl", false, "keyctl(GET_KEYRING_ID, user keyring): %v", err)
		return
	}
	same := "not the host root's"
	if id == hostKeyring {
		same = "the host root's own user keyring"
	}
	report("keyctl", true, "keyctl reached user keyring %d (%s, host root's is %d)", id, same, hostKeyring)
}

func mountTmpfs() {
	dir, err := os.MkdirTemp("", "escape-mnt-")
	if err != nil {
		report("mount", false, "mkdtemp: %v", err)
		return
	}
	defer os.Remove(dir)
	if err := unix.Mount("escape", dir, "tmpfs", 0, "size=1m"); err != nil {
		report("mount", false, "mount(tmpfs): %v", err)
		return
	}
	_ = unix.Unmount(dir, unix.MNT_DETACH)
	report("mount", true, "mount(tmpfs) on %s worked", dir)
}

func bpf() {
	// union bpf_attr for BPF_MAP_CREATE: type, key size, value size,
	// max entries (an array map of one u32).
	attr := [48]byte{}
	binary.LittleEndian.PutUint32(attr[0:], 2) // BPF_MAP_TYPE_ARRAY
	binary.LittleEndian.PutUint32(attr[4:], 4)
	binary.LittleEndian.PutUint32(attr[8:], 4)
	binary.LittleEndian.PutUint32(attr[12:], 1)
	fd, _, errno := unix.Syscall(unix.SYS_BPF, 0 /* BPF_MAP_CREATE */, uintptr(unsafe.Pointer(&attr[0])), uintptr(len(attr)))
	if errno != 0 {
		report("bpf", false, "bpf(BPF_MAP_CREATE): %v", errno)
		return
	}
	unix.Close(int(fd))
	report("bpf", true, "bpf(BPF_MAP_CREATE) returned a map fd")
}

// findMarker returns the pids whose command line contains marker.
func findMarker(marker string) []int {
	var out []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		cmd, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err == nil && bytes.Contains(cmd, []byte(marker)) {
			out = append(out, pid)
		}
	}
	return out
}

// attach seizes pid, stops it, and detaches: what a debugger (or an
// attacker injecting code) does first.
func attach(pid int) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := unix.PtraceSeize(pid); err != nil {
		return fmt.Errorf("PTRACE_SEIZE %d: %w", pid, err)
	}
	if err := unix.PtraceInterrupt(pid); err != nil {
		return fmt.Errorf("PTRACE_INTERRUPT %d: %w", pid, err)
	}
	var ws unix.WaitStatus
	if _, err := unix.Wait4(pid, &ws, unix.WALL, nil); err != nil {
		return fmt.Errorf("wait %d: %w", pid, err)
	}
	return unix.PtraceDetach(pid)
}

func ptraceHost(marker string, hostPID int) {
	pids := findMarker(marker)
	if len(pids) == 0 {
		// The pid number alone: whatever it names here is not the host
		// process (its command line would carry the marker).
		err := unix.Kill(hostPID, 0)
		report("ptrace-host", false, "no process with marker %q visible; kill(%d, 0): %v", marker, hostPID, err)
		return
	}
	if err := attach(pids[0]); err != nil {
		report("ptrace-host", false, "host process visible as pid %d, but %v", pids[0], err)
		return
	}
	report("ptrace-host", true, "attached to the host process (pid %d here)", pids[0])
}

func ptraceAgent() {
	var got []string
	if err := attach(1); err == nil {
		got = append(got, "ptrace-attached PID 1")
	} else {
		got = append(got, err.Error())
	}
	env, err := os.ReadFile("/proc/1/environ")
	if err == nil {
		got = append(got, fmt.Sprintf("read %d bytes of /proc/1/environ", len(env)))
	} else {
		got = append(got, "environ: "+err.Error())
	}
	report("ptrace-agent", strings.HasPrefix(got[0], "ptrace-attached") || err == nil, "%s", strings.Join(got, "; "))
}

func proc1fd1(pid int) {
	p := fmt.Sprintf("/proc/%d/fd/1", pid)
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		report("proc1-fd1", false, "open %s: %v", p, err)
		return
	}
	defer f.Close()
	if _, err := f.WriteString("escape suite: a sandbox process writes to its agent's stdout\n"); err != nil {
		report("proc1-fd1", false, "write %s: %v", p, err)
		return
	}
	report("proc1-fd1", true, "wrote to PID %d's stdout through %s", pid, p)
}

// writeSame writes a host-wide setting's current value back: proof of
// write access that changes nothing.
func writeSame(row, path string) {
	v, err := os.ReadFile(path)
	if err != nil {
		report(row, false, "read %s: %v", path, err)
		return
	}
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		report(row, false, "open %s for writing: %v", path, err)
		return
	}
	defer f.Close()
	if _, err := f.Write(bytes.TrimSpace(v)); err != nil {
		report(row, false, "write %s: %v", path, err)
		return
	}
	report(row, true, "wrote %q back to %s", bytes.TrimSpace(v), path)
}

func agentBinary(path string) {
	fi, err := os.Stat(path)
	if err != nil {
		report("agent-binary", false, "stat %s: %v", path, err)
		return
	}
	// chmod to the same mode: a metadata write that changes nothing, and
	// unlike an open for writing it does not meet ETXTBSY first.
	if err := os.Chmod(path, fi.Mode().Perm()); err != nil {
		report("agent-binary", false, "chmod %s: %v", path, err)
		return
	}
	report("agent-binary", true, "chmod %s worked (the file is writable from here)", path)
}

func plantSetuid(path string) {
	self, err := os.ReadFile("/proc/self/exe")
	if err == nil {
		err = os.WriteFile(path, self, 0o755)
	}
	if err == nil {
		err = os.Chown(path, 0, 0)
	}
	if err == nil {
		err = os.Chmod(path, os.ModeSetuid|0o755) // os.Chmod ignores 0o4000
	}
	if err != nil {
		report("plant-setuid", false, "plant %s: %v", path, err)
		return
	}
	report("plant-setuid", true, "planted setuid-root %s", path)
}

func mknod(dir string) {
	p := filepath.Join(dir, "escape-dev")
	_ = os.Remove(p)
	// /dev/mem's numbers: a device a host account must never reach.
	if err := unix.Mknod(p, unix.S_IFCHR|0o666, int(unix.Mkdev(1, 1))); err != nil {
		report("mknod", false, "mknod c 1 1: %v", err)
		return
	}
	report("mknod", true, "made char device 1:1 (/dev/mem) at %s", p)
}

// create makes a file at path (a write to a host directory bound
// read-only, when the sandbox has one there).
func create(row, path string) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		report(row, false, "create %s: %v", path, err)
		return
	}
	f.Close()
	report(row, true, "created %s", path)
}

// ipv6: any IPv6 answer on the sandbox's link (the all-nodes group
// answers echo requests) means an IPv6 path the IPv4 rules do not see.
func ipv6() {
	addrs, _ := os.ReadFile("/proc/net/if_inet6")
	var mine []string
	for _, l := range strings.Split(strings.TrimSpace(string(addrs)), "\n") {
		if f := strings.Fields(l); len(f) == 6 && f[5] != "lo" {
			mine = append(mine, f[5]+":"+f[0])
		}
	}
	ifname := "eth0"
	reply, err := ping6("ff02::1%"+ifname, 1500*time.Millisecond, ownAddrs(addrs))
	if err != nil {
		report("ipv6", false, "IPv6 addresses %v; echo to ff02::1%%%s: %v", mine, ifname, err)
		return
	}
	report("ipv6", true, "IPv6 addresses %v; ff02::1%%%s answered from %s", mine, ifname, reply)
}

// ownAddrs are the addresses in /proc/net/if_inet6: a multicast echo is
// looped back to the sender, whose own answer proves no path.
func ownAddrs(ifInet6 []byte) map[netip.Addr]bool {
	own := map[netip.Addr]bool{}
	for _, l := range strings.Split(string(ifInet6), "\n") {
		f := strings.Fields(l)
		if len(f) == 6 && len(f[0]) == 32 {
			var b [16]byte
			for i := range b {
				v, _ := strconv.ParseUint(f[0][2*i:2*i+2], 16, 8)
				b[i] = byte(v)
			}
			own[netip.AddrFrom16(b)] = true
		}
	}
	return own
}

func ping6(addr string, wait time.Duration, own map[netip.Addr]bool) (string, error) {
	ip, err := netip.ParseAddr(addr)
	if err != nil {
		return "", err
	}
	fd, err := unix.Socket(unix.AF_INET6, unix.SOCK_DGRAM, unix.IPPROTO_ICMPV6)
	if err != nil {
		// A VM guest's root: ping_group_range closed, CAP_NET_RAW held.
		fd2, err2 := unix.Socket(unix.AF_INET6, unix.SOCK_RAW, unix.IPPROTO_ICMPV6)
		if err2 != nil {
			return "", fmt.Errorf("icmpv6 socket: %w; raw: %w", err, err2)
		}
		fd = fd2
	}
	defer unix.Close(fd)
	sa := &unix.SockaddrInet6{Addr: ip.As16()}
	if z := ip.Zone(); z != "" {
		ifi, err := net.InterfaceByName(z)
		if err != nil {
			return "", err
		}
		sa.ZoneId = uint32(ifi.Index)
	}
	msg := []byte{128, 0, 0, 0, 0, 1, 0, 1, 'c', 'u', 'b', 'e'} // echo request
	if err := unix.Sendto(fd, msg, 0, sa); err != nil {
		return "", fmt.Errorf("sendto: %w", err)
	}
	tv := unix.NsecToTimeval(wait.Nanoseconds())
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	buf := make([]byte, 1500)
	for {
		n, from, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			return "", fmt.Errorf("no answer: %w", err)
		}
		if n > 0 && buf[0] == 129 {
			f, ok := from.(*unix.SockaddrInet6)
			if !ok {
				return "?", nil
			}
			if a := netip.AddrFrom16(f.Addr); !own[a] {
				return a.String(), nil
			}
		}
	}
}

// swap replaces the directory dir (in a host directory the sandbox has
// bound) by a symlink to target, a path as the host sees it: whoever
// binds dir by name after that gets target.
func swap(dir, target string) {
	if err := os.Rename(dir, dir+".old"); err != nil {
		fmt.Printf("swap\tblocked\trename: %v\n", err)
		return
	}
	if err := os.Symlink(target, dir); err != nil {
		fmt.Printf("swap\tblocked\tsymlink: %v\n", err)
		return
	}
	fmt.Printf("swap\tescaped\t%s -> %s\n", dir, target)
}

// rawSpoof sends a TCP SYN, a UDP datagram and an ICMP echo request from
// a forged source on a raw socket; the suite's capture in the world says
// whether any arrived. Each payload carries nonce-<proto>.
func rawSpoof(o opts) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_RAW)
	if err != nil {
		report("raw-spoof", false, "socket(AF_INET, SOCK_RAW): %v", err)
		return
	}
	defer unix.Close(fd)
	src, err1 := netip.ParseAddr(o.spoofSrc)
	dst, err2 := netip.ParseAddr(o.world)
	if err := errors.Join(err1, err2); err != nil {
		report("raw-spoof", false, "addresses: %v", err)
		return
	}
	var sent []string
	for _, proto := range []string{"tcp", "udp", "icmp"} {
		pkt := packet(proto, src, dst, o.port, []byte(o.nonce+"-"+proto))
		if err := unix.Sendto(fd, pkt, 0, &unix.SockaddrInet4{Addr: dst.As4()}); err != nil {
			sent = append(sent, proto+": "+err.Error())
			continue
		}
		sent = append(sent, proto+" sent")
	}
	fmt.Printf("raw-spoof\tsent\tfrom %s to %s:%d: %s\n", src, dst, o.port, strings.Join(sent, ", "))
}

func checksum(b []byte) uint16 {
	var s uint32
	for i := 0; i+1 < len(b); i += 2 {
		s += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		s += uint32(b[len(b)-1]) << 8
	}
	for s>>16 != 0 {
		s = s&0xffff + s>>16
	}
	return ^uint16(s)
}

// packet builds an IPv4 packet (header and all) carrying payload.
func packet(proto string, src, dst netip.Addr, port int, payload []byte) []byte {
	var l4 []byte
	var num byte
	switch proto {
	case "tcp":
		num = unix.IPPROTO_TCP
		l4 = make([]byte, 20+len(payload))
		binary.BigEndian.PutUint16(l4[0:], 40001)
		binary.BigEndian.PutUint16(l4[2:], uint16(port))
		binary.BigEndian.PutUint32(l4[4:], 1)
		l4[12] = 5 << 4 // data offset
		l4[13] = 0x02   // SYN
		binary.BigEndian.PutUint16(l4[14:], 65535)
		copy(l4[20:], payload)
	case "udp":
		num = unix.IPPROTO_UDP
		l4 = make([]byte, 8+len(payload))
		binary.BigEndian.PutUint16(l4[0:], 40002)
		binary.BigEndian.PutUint16(l4[2:], uint16(port))
		binary.BigEndian.PutUint16(l4[4:], uint16(len(l4)))
		copy(l4[8:], payload)
	default:
		num = unix.IPPROTO_ICMP
		l4 = make([]byte, 8+len(payload))
		l4[0] = 8 // echo request
		binary.BigEndian.PutUint16(l4[4:], 0x4242)
		binary.BigEndian.PutUint16(l4[6:], 1)
		copy(l4[8:], payload)
		binary.BigEndian.PutUint16(l4[2:], checksum(l4))
	}
	if num != unix.IPPROTO_ICMP {
		pseudo := make([]byte, 12, 12+len(l4))
		copy(pseudo[0:], src.AsSlice())
		copy(pseudo[4:], dst.AsSlice())
		pseudo[9] = num
		binary.BigEndian.PutUint16(pseudo[10:], uint16(len(l4)))
		sum := checksum(append(pseudo, l4...))
		if num == unix.IPPROTO_TCP {
			binary.BigEndian.PutUint16(l4[16:], sum)
		} else {
			binary.BigEndian.PutUint16(l4[6:], sum)
		}
	}
	ip := make([]byte, 20, 20+len(l4))
	ip[0] = 0x45
	binary.BigEndian.PutUint16(ip[2:], uint16(20+len(l4)))
	ip[8], ip[9] = 64, num
	copy(ip[12:], src.AsSlice())
	copy(ip[16:], dst.AsSlice())
	binary.BigEndian.PutUint16(ip[10:], checksum(ip))
	return append(ip, l4...)
}

// netRows tries every target at once; each prints one line.
func netRows(targets []string) {
	var wg sync.WaitGroup
	lines := make([]string, len(targets))
	for i, t := range targets {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lines[i] = reach(t)
		}()
	}
	wg.Wait()
	for _, l := range lines {
		fmt.Println(l)
	}
}

// netWait is long enough for a TCG guest on a loaded machine; the
// targets are tried at once, so it is paid once.
const netWait = 3 * time.Second

// reach: name=proto:addr:port. An answer of any kind (a greeting, an
// echo, a refusal, which is the far end's RST or ICMP error) is
// "escaped": the packet got there. Silence is "blocked".
func reach(spec string) string {
	name, rest, _ := strings.Cut(spec, "=")
	proto, hp, _ := strings.Cut(rest, ":")
	line := func(escaped bool, format string, a ...any) string {
		w := "blocked"
		if escaped {
			w = "escaped"
		}
		return fmt.Sprintf("%s\t%s\t%s %s: %s", name, w, proto, hp, fmt.Sprintf(format, a...))
	}
	switch proto {
	case "tcp":
		c, err := net.DialTimeout("tcp4", hp, netWait)
		if err != nil {
			return line(errors.Is(err, unix.ECONNREFUSED), "%v", err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(netWait))
		g, _ := bufio.NewReader(c).ReadString('\n')
		return line(true, "connected, greeting %q", strings.TrimSpace(g))
	case "udp":
		c, err := net.Dial("udp4", hp)
		if err != nil {
			return line(false, "%v", err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(netWait))
		if _, err := c.Write([]byte("escape-udp")); err != nil {
			return line(errors.Is(err, unix.ECONNREFUSED), "%v", err)
		}
		buf := make([]byte, 64)
		n, err := c.Read(buf)
		if err != nil {
			return line(errors.Is(err, unix.ECONNREFUSED), "%v", err)
		}
		return line(true, "answer %q", buf[:n])
	case "icmp":
		host, _, _ := net.SplitHostPort(hp)
		from, err := ping4(host)
		if err != nil {
			return line(false, "%v", err)
		}
		return line(true, "echo reply from %s", from)
	}
	return line(false, "unknown protocol")
}

func ping4(host string) (string, error) {
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return "", err
	}
	// A datagram ICMP socket where ping_group_range allows (containers),
	// a raw one otherwise (a VM guest's root).
	raw := false
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM, unix.IPPROTO_ICMP)
	if err != nil {
		fd2, err2 := unix.Socket(unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_ICMP)
		if err2 != nil {
			return "", fmt.Errorf("icmp socket: %w; raw: %w", err, err2)
		}
		fd, raw = fd2, true
	}
	defer unix.Close(fd)
	msg := []byte{8, 0, 0, 0, 0x42, 0x43, 0, 1, 'c', 'u', 'b', 'e'}
	binary.BigEndian.PutUint16(msg[2:], checksum(msg))
	if err := unix.Sendto(fd, msg, 0, &unix.SockaddrInet4{Addr: ip.As4()}); err != nil {
		return "", fmt.Errorf("sendto: %w", err)
	}
	tv := unix.NsecToTimeval(netWait.Nanoseconds())
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	buf := make([]byte, 1500)
	for {
		n, from, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			return "", fmt.Errorf("no answer: %w", err)
		}
		b := buf[:n]
		if raw && n >= 20 {
			b = b[int(b[0]&0x0f)*4:]
		}
		// A raw socket sees every ICMP packet: only the target's reply
		// to this request counts.
		if f, ok := from.(*unix.SockaddrInet4); ok && len(b) >= 8 && b[0] == 0 && netip.AddrFrom4(f.Addr) == ip {
			if !raw || (b[4] == 0x42 && b[5] == 0x43) {
				return ip.String(), nil
			}
		}
	}
}

// forkbomb starts sleeping children until fork fails or n run, prints
// the count and the error, and kills them.
func forkbomb(n int) {
	// busybox sleep: one thread per process (a Go child would count
	// several against the pids limit).
	bin, argv := "/bin/sleep", []string{"sleep", "60"}
	if _, err := os.Stat(bin); err != nil {
		bin, argv = "/proc/self/exe", []string{"probe", "sleep", "60"}
	}
	var procs []*os.Process
	var last error
	for len(procs) < n {
		p, err := os.StartProcess(bin, argv, &os.ProcAttr{})
		if err != nil {
			last = err
			break
		}
		procs = append(procs, p)
	}
	for _, p := range procs {
		_ = p.Kill()
		_, _ = p.Wait()
	}
	fmt.Printf("forkbomb\t%d\t%v\n", len(procs), last)
}

// membomb touches mib MiB in 8 MiB steps, printing progress so that an
// OOM kill shows how far it got.
func membomb(mib int) {
	var keep [][]byte
	for got := 0; got < mib; got += 8 {
		b := make([]byte, 8<<20)
		for i := 0; i < len(b); i += 4096 {
			b[i] = 1
		}
		keep = append(keep, b)
		fmt.Printf("membomb\t%d\n", got+8)
	}
	fmt.Printf("membomb\tdone\t%d\n", len(keep)*8)
}

func fill(path string) {
	f, err := os.Create(path)
	if err != nil {
		fmt.Printf("fill\t0\t%v\n", err)
		return
	}
	buf := bytes.Repeat([]byte{0xa5}, 1<<20)
	var n int64
	for {
		k, err := f.Write(buf)
		n += int64(k)
		if err != nil {
			_ = f.Sync()
			f.Close()
			fmt.Printf("fill\t%d\t%v\n", n, err)
			return
		}
		if n > 64<<30 {
			fmt.Printf("fill\t%d\tstopped at 64 GiB\n", n)
			return
		}
	}
}

// inotifyHold takes inotify instances until the kernel refuses or limit
// are held, prints the count, and holds them for seconds.
func inotifyHold(limit, seconds int) {
	var fds []int
	var last error
	for len(fds) < limit {
		fd, err := unix.InotifyInit1(unix.IN_CLOEXEC)
		if err != nil {
			last = err
			break
		}
		fds = append(fds, fd)
	}
	fmt.Printf("inotify\t%d\t%v\n", len(fds), last)
	_ = os.Stdout.Sync()
	time.Sleep(time.Duration(seconds) * time.Second)
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// egressRows: "-lookup a,b" resolves those names through the sandbox's
// own resolver first (so their addresses are the sandbox's), then each
// spec row=tls|http:addr:port:name[:name2] makes one connection: TLS with
// server name name ("-": none, an IP literal) and a GET for it, or plain
// HTTP with Host name, then, with name2, a second request on the same
// connection for Host name2. An HTTP response to the (last) request is
// "escaped".
func egressRows(args []string) {
	if len(args) > 1 && args[0] == "-lookup" {
		for _, n := range strings.Split(args[1], ",") {
			ctx, cancel := context.WithTimeout(context.Background(), netWait)
			addrs, err := net.DefaultResolver.LookupHost(ctx, n)
			cancel()
			fmt.Fprintf(os.Stderr, "lookup %s: %v %v\n", n, addrs, err)
		}
		args = args[2:]
	}
	var wg sync.WaitGroup
	lines := make([]string, len(args))
	for i, spec := range args {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lines[i] = egressTry(spec)
		}()
	}
	wg.Wait()
	for _, l := range lines {
		fmt.Println(l)
	}
}

func egressTry(spec string) string {
	row, rest, _ := strings.Cut(spec, "=")
	f := strings.Split(rest, ":")
	line := func(escaped bool, format string, a ...any) string {
		word := "blocked"
		if escaped {
			word = "escaped"
		}
		return fmt.Sprintf("%s\t%s\t%s: %s", row, word, rest, strings.ReplaceAll(fmt.Sprintf(format, a...), "\n", " | "))
	}
	if len(f) < 4 {
		return line(false, "bad spec")
	}
	mode, addr, name := f[0], net.JoinHostPort(f[1], f[2]), f[3]
	c, err := net.DialTimeout("tcp4", addr, netWait)
	if err != nil {
		return line(false, "connect: %v", err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(netWait))
	host := name
	if mode == "tls" {
		sni := name
		if name == "-" {
			sni, host = "", f[1]
		}
		// An attacker verifies nothing.
		tc := tls.Client(c, &tls.Config{ServerName: sni, InsecureSkipVerify: true})
		if err := tc.Handshake(); err != nil {
			return line(false, "TLS handshake: %v", err)
		}
		c = tc
	}
	br := bufio.NewReader(c)
	get := func(h string) (string, error) {
		if _, err := fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: %s\r\n\r\n", h); err != nil {
			return "", err
		}
		status, err := br.ReadString('\n')
		if err != nil {
			return "", err
		}
		length := 0
		for {
			l, err := br.ReadString('\n')
			if err != nil {
				return "", err
			}
			if k, v, ok := strings.Cut(l, ":"); ok && strings.EqualFold(k, "Content-Length") {
				length, _ = strconv.Atoi(strings.TrimSpace(v))
			}
			if l == "\r\n" {
				break
			}
		}
		body := make([]byte, length)
		if _, err := io.ReadFull(br, body); err != nil {
			return "", err
		}
		return strings.TrimSpace(status) + " " + strings.TrimSpace(string(body)), nil
	}
	got, err := get(host)
	if err != nil {
		return line(false, "request for %s: %v", host, err)
	}
	if len(f) > 4 {
		got2, err := get(f[4])
		if err != nil {
			return line(false, "first request answered (%s); second, for %s: %v", got, f[4], err)
		}
		return line(true, "both answered: %s; %s", got, got2)
	}
	return line(true, "answered: %s", got)
}
