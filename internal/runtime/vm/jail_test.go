package vm

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/testenv"
	"github.com/cubesandbox/cube/internal/vmguest"
)

// probeBin is a static busybox: the only program that runs inside a
// QEMU's jail without its libraries, bound there (tests only) as
// jailProbe so probes can run in QEMU's own mount namespace. Its name
// must stay "busybox": busybox picks the applet from argv[0] otherwise.
const (
	probeBin  = vmguest.DefaultBusybox
	jailProbe = "/busybox"
)

// TestJailConfinement treats QEMU as the attacker: two VMs run, and what
// VM A's QEMU process is and can reach is probed from the host with its
// exact uid/gid in its own namespaces (nsenter with a static busybox).
// Every row has a control: the same probe succeeds for root in the host,
// or with the one protection in question removed.
func TestJailConfinement(t *testing.T) {
	requireVM(t)
	testenv.RequireBinary(t, "nsenter", "util-linux")
	if _, err := os.Stat(probeBin); err != nil {
		testenv.Missing(t, "needs busybox-static at "+probeBin)
	}
	e := newEnv(t)
	e.d.jailExtra = []jailBind{{From: probeBin, To: jailProbe}}
	logs := &syncBuf{}
	e.d.log = slog.New(slog.NewTextHandler(io.MultiWriter(tWriter{t}, logs), &slog.HandlerOptions{Level: slog.LevelDebug}))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	sa, sb := e.spec(t, "ja"), e.spec(t, "jb")
	var a, b *vmState
	for _, sp := range []struct {
		id string
		st **vmState
	}{{sa.ID, &a}, {sb.ID, &b}} {
		spec := sa
		if sp.id == sb.ID {
			spec = sb
		}
		stopAtEnd(t, e.d, sp.id)
		if _, err := e.d.Start(ctx, spec); err != nil {
			t.Fatal(err)
		}
		st, err := e.d.load(sp.id)
		if err != nil {
			t.Fatal(err)
		}
		*sp.st = st
	}
	ua, ub := strconv.Itoa(int(a.UID)), strconv.Itoa(int(b.UID))
	t.Logf("QEMU A pid %d uid %s, QEMU B pid %d uid %s", a.PID, ua, b.PID, ub)

	t.Run("ProcessStatus", func(t *testing.T) {
		st := procStatus(t, a.PID)
		want := map[string]string{
			"Uid": strings.Repeat(ua+"\t", 3) + ua, "Gid": strings.Repeat(ua+"\t", 3) + ua, "Groups": "",
			"CapInh": "0000000000000000", "CapPrm": "0000000000000000", "CapEff": "0000000000000000",
			"CapBnd": "0000000000000000", "CapAmb": "0000000000000000", "NoNewPrivs": "1", "Seccomp": "2",
		}
		for k, v := range want {
			if st[k] != v {
				t.Errorf("QEMU %s = %q, want %q", k, st[k], v)
			}
		}
		if a.UID < DefaultUIDBase || a.UID >= DefaultUIDBase+DefaultUIDCount || a.UID == b.UID {
			t.Errorf("uids %d and %d: want two different uids in [%d, +%d)", a.UID, b.UID, DefaultUIDBase, DefaultUIDCount)
		}
		t.Logf("attack: QEMU's credentials: %v", st)
		// Control: the same fields of an unconfined root process (this
		// test) read otherwise, so the reading itself is not what says 0.
		self := procStatus(t, os.Getpid())
		if self["Uid"] == want["Uid"] || self["CapEff"] == want["CapEff"] || self["Seccomp"] == want["Seccomp"] {
			t.Errorf("control: this root process reads %v: the probe cannot tell", self)
		}
		t.Logf("control: the test process (root): Uid %s CapEff %s NoNewPrivs %s Seccomp %s", self["Uid"], self["CapEff"], self["NoNewPrivs"], self["Seccomp"])
	})

	otherDisk := sb.Disk
	shadow := "/etc/shadow"
	t.Run("MountJail", func(t *testing.T) {
		// As QEMU A: its uid and gid, in its mount and network namespace.
		asQEMU := func(args ...string) (string, error) {
			return probeRun(exec.Command("nsenter", append([]string{"-t", itoa(a.PID), "-m", "-n", "-S", ua, "-G", ua, "--", jailProbe}, args...)...))
		}
		asRoot := func(args ...string) (string, error) { return probeRun(exec.Command(probeBin, args...)) }
		for _, f := range []string{otherDisk, sa.Disk, shadow, "/proc/self/status", filepath.Dir(e.d.root)} {
			out, err := asQEMU("cat", f)
			if err == nil {
				t.Errorf("attack: QEMU A read %s: %.80q", f, out)
				continue
			}
			t.Logf("attack: QEMU A cat %s: %s (stopped by the jail: no such path)", f, firstLine(out))
			if !strings.Contains(out, "No such file") && !strings.Contains(out, "Is a directory") {
				t.Errorf("attack: cat %s failed for another reason than the jail: %s", f, out)
			}
			if f == sa.Disk || f == filepath.Dir(e.d.root) || strings.HasPrefix(f, "/proc") {
				continue // its own disk is an fd; the dir is not a file
			}
			if out, err := asRoot("cat", f); err != nil {
				t.Errorf("control: root in the host cannot read %s: %v: %s", f, err, out)
			}
		}
		out, err := asQEMU("ls", "-a", "/")
		if err != nil {
			t.Fatalf("ls / in the jail: %v: %s", err, out)
		}
		got := strings.Fields(out)
		t.Logf("attack: QEMU A's / holds %v", got)
		for _, host := range []string{"etc/shadow", "root", "home", "proc", "sys", "var", "tmp", "run"} {
			if _, err := asQEMU("stat", "/"+host); err == nil {
				t.Errorf("attack: /%s exists in QEMU's root", host)
			}
		}
		// Controls: root in the host sees the host's root; root inside
		// QEMU's mount namespace still cannot find the files, so the
		// mount jail (not the uid) is what stops the row above.
		if out, err := asRoot("ls", "/"); err != nil || !strings.Contains(out, "etc") {
			t.Errorf("control: host / = %v %q", err, out)
		}
		if out, err := probeRun(exec.Command("nsenter", "-t", itoa(a.PID), "-m", "--", jailProbe, "cat", shadow)); err == nil || !strings.Contains(out, "No such file") {
			t.Errorf("control: root in QEMU's mount ns: cat %s = %v %q, want no such file", shadow, err, out)
		}
		if out, err := asQEMU("touch", "/x"); err == nil || !strings.Contains(out, "Read-only") {
			t.Errorf("attack: writing the jail's root: %v %q", err, out)
		} else {
			t.Logf("attack: touch /x in the jail: %s", firstLine(out))
		}
	})

	t.Run("UIDPerVM", func(t *testing.T) {
		// Without the mount jail, in the host's namespaces, A's uid alone:
		// B's disk (by path and through B's own descriptor) and
		// /etc/shadow stay closed, and B cannot be signalled.
		cred := func(uid uint32) *syscall.SysProcAttr {
			return &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid, Groups: []uint32{}}}
		}
		probe := func(uid uint32, args ...string) (string, error) {
			c := exec.Command(probeBin, args...)
			c.SysProcAttr = cred(uid)
			return probeRun(c)
		}
		bDiskFD := fdOf(t, b.PID, sb.Disk)
		for _, f := range []string{otherDisk, bDiskFD, shadow} {
			out, err := probe(a.UID, "head", "-c", "16", f)
			if err == nil || !strings.Contains(out, "Permission denied") {
				t.Errorf("attack: uid %s, head %s: %v %q; want permission denied", ua, f, err, out)
				continue
			}
			t.Logf("attack: as QEMU A's uid in the host: head %s: %s", f, firstLine(out))
		}
		out, err := probe(a.UID, "kill", "-0", itoa(b.PID))
		if err == nil || !strings.Contains(out, "not permitted") {
			t.Errorf("attack: uid %s may signal QEMU B", ua)
		}
		t.Logf("attack: kill -0 QEMU B as uid %s: %s", ua, firstLine(out))
		// Controls: with one shared uid (B's own) the same probes reach
		// B's disk through its descriptor and signal it: a per-VM uid is
		// what stops them. Root reads the disk and /etc/shadow by path.
		if out, err := probe(b.UID, "head", "-c", "16", bDiskFD); err != nil {
			t.Errorf("control: B's uid cannot read B's disk through %s: %v %s", bDiskFD, err, out)
		}
		if out, err := probe(b.UID, "kill", "-0", itoa(b.PID)); err != nil {
			t.Errorf("control: B's uid cannot signal B: %v %s", err, out)
		}
		for _, f := range []string{otherDisk, shadow} {
			if out, err := probe(0, "head", "-c", "16", f); err != nil {
				t.Errorf("control: root cannot read %s: %v %s", f, err, out)
			}
		}
	})

	t.Run("NetworkNamespace", func(t *testing.T) {
		// A VM without a NIC gets an empty network namespace: a host
		// service on loopback is out of QEMU's reach.
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				c.Close()
			}
		}()
		port := strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
		out, err := probeRun(exec.Command("nsenter", "-t", itoa(a.PID), "-m", "-n", "-S", ua, "-G", ua, "--", jailProbe, "nc", "-w", "2", "127.0.0.1", port))
		if err == nil || !strings.Contains(out, "unreachable") {
			t.Errorf("attack: QEMU A's namespace, 127.0.0.1:%s: %v %q; want network unreachable", port, err, out)
		}
		t.Logf("attack: nc 127.0.0.1:%s from QEMU A's netns: %s", port, firstLine(out))
		// Control: the same probe and uid in the host's network namespace.
		c := exec.Command(probeBin, "nc", "-w", "2", "127.0.0.1", port)
		c.Stdin = strings.NewReader("")
		c.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: a.UID, Gid: a.UID, Groups: []uint32{}}}
		if out, err := probeRun(c); err != nil {
			t.Errorf("control: uid %s in the host netns cannot reach 127.0.0.1:%s: %v %s", ua, port, err, out)
		}
	})

	// Last: it ends QEMU A.
	t.Run("SeccompSpawn", func(t *testing.T) {
		// As a compromised QEMU would: start a program. QMP's "exec:"
		// migration makes QEMU fork and exec /bin/sh; spawn=deny kills it.
		err := e.d.execute(ctx, a, "migrate", map[string]any{"uri": "exec:cat >/dev/null"}, nil)
		if gerr := waitGone(a, 5*time.Second); gerr != nil {
			t.Fatalf("attack: QEMU A survived spawning (migrate: %v)", err)
		}
		var exit string
		for i := 0; i < 100 && exit == ""; i++ {
			for _, l := range strings.Split(logs.String(), "\n") {
				if strings.Contains(l, "qemu exited") && strings.Contains(l, "id="+sa.ID) {
					exit = l
				}
			}
			time.Sleep(10 * time.Millisecond)
		}
		if !strings.Contains(exit, "bad system call") {
			t.Errorf("attack: QEMU A ended otherwise than by seccomp: %q (migrate: %v)", exit, err)
		}
		t.Logf("attack: migrate to exec: in QEMU A: %v; %s", err, exit)
		// Control: the same command to a QEMU without -sandbox runs the
		// program and completes.
		cctx, ccancel := context.WithTimeout(ctx, 20*time.Second)
		defer ccancel()
		c := exec.CommandContext(cctx, e.d.qemu, "-M", "none", "-S", "-display", "none", "-nodefaults", "-qmp", "stdio")
		c.Stdin = strings.NewReader(`{"execute":"qmp_capabilities"}
{"execute":"migrate","arguments":{"uri":"exec:cat >/dev/null"}}
{"execute":"quit"}
`)
		out, _ := probeRun(c)
		if strings.Count(out, `"return": {}`) < 3 {
			t.Errorf("control: unsandboxed QEMU refused exec: migration: %s", out)
		}
		t.Logf("control: QEMU without -sandbox: migrate exec: accepted")
	})
}

// syncBuf collects log output from the driver's goroutines.
type syncBuf struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestUIDAlloc: distinct uids, persistence in the shared directory (a
// second allocator, as after a cubelet restart or another driver of the
// host, does not hand out a live VM's uid), exhaustion, release only by
// the owner, and reclaim of a crashed start's leftover.
func TestUIDAlloc(t *testing.T) {
	root := t.TempDir()
	dir := filepath.Join(root, "uids")
	a := uidAlloc{dir: dir, base: 5000, count: 3}
	state := func(id string) string { return filepath.Join(root, id) }
	for _, id := range []string{"x", "y", "w", "v"} {
		if err := os.Mkdir(state(id), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	ux, err := a.take(state("x"))
	if err != nil {
		t.Fatal(err)
	}
	uy, err := uidAlloc{dir: dir, base: 5000, count: 3}.take(state("y"))
	if err != nil || uy == ux || uy < 5000 || uy > 5002 {
		t.Fatalf("second allocator: %d, %v (first has %d)", uy, err, ux)
	}
	// "z" has no state dir: its file is a crash leftover, reclaimed.
	if _, err := a.take(state("z")); err != nil {
		t.Fatal(err)
	}
	if _, err := a.take(state("w")); err != nil {
		t.Fatalf("z's leftover was not reclaimed: %v", err)
	}
	if _, err := a.take(state("v")); !errdefs.IsResourceExhausted(err) {
		t.Fatalf("a fourth live uid out of three: %v", err)
	}
	if err := a.release(ux, state("y")); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(a.file(ux)); err != nil {
		t.Errorf("release by another owner freed x's uid")
	}
	if err := a.release(ux, state("x")); err != nil {
		t.Fatal(err)
	}
	if u, err := a.take(state("v")); err != nil || u != ux {
		t.Errorf("after release: %d, %v; want %d", u, err, ux)
	}
}

func procStatus(t *testing.T, pid int) map[string]string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok {
			m[k] = strings.TrimSpace(v)
		}
	}
	return m
}

// fdOf is /proc/<pid>/fd/<n> for the descriptor pid holds on path.
func fdOf(t *testing.T, pid int, path string) string {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if l, _ := os.Readlink(filepath.Join(dir, e.Name())); l == path {
			return filepath.Join(dir, e.Name())
		}
	}
	t.Fatalf("pid %d holds no descriptor on %s", pid, path)
	return ""
}

func probeRun(c *exec.Cmd) (string, error) {
	out, err := c.CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

func firstLine(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	return s
}

// TestJailKVMNode: under KVM a jailed QEMU opens the /dev/kvm node the
// helper makes in its jail, owned by its uid (the host's is root's, 0600).
// Control: the same node left to root, and QEMU cannot use KVM.
func TestJailKVMNode(t *testing.T) {
	testenv.RequireRoot(t, "mount namespaces, mknod")
	testenv.RequireBinary(t, "qemu-system-x86_64", "qemu-system-x86")
	major, minor, err := charDev("/dev/kvm")
	if err != nil {
		t.Skipf("no usable /dev/kvm on this host: %v", err)
	}
	qemu, err := filepath.EvalSymlinks("/usr/bin/qemu-system-x86_64")
	if err != nil {
		t.Fatal(err)
	}
	binds, err := qemuFiles(qemu)
	if err != nil {
		t.Fatal(err)
	}
	for _, own := range []bool{true, false} {
		jd := filepath.Join(t.TempDir(), "jail")
		if err := os.Mkdir(jd, 0o700); err != nil {
			t.Fatal(err)
		}
		spec := jailSpec{
			Dir: jd, UID: DefaultUIDBase + DefaultUIDCount - 1, GID: DefaultUIDBase + DefaultUIDCount - 1, NetNS: -1, Binds: binds, Exec: qemu,
			Argv:  []string{qemu, "-M", "none", "-accel", "kvm", "-display", "none", "-nodefaults", "-S", "-sandbox", sandboxOpts, "-qmp", "stdio"},
			Nodes: []jailNode{{Path: "/dev/null", Major: 1, Minor: 3, Mode: 0o666}, {Path: "/dev/kvm", Major: major, Minor: minor, Mode: 0o600, Own: own}},
		}
		arg, err := json.Marshal(spec)
		if err != nil {
			t.Fatal(err)
		}
		cmd := &exec.Cmd{Path: "/proc/self/exe", Args: []string{jailArg0, string(arg)}, Env: []string{}}
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Cloneflags: syscall.CLONE_NEWNS | syscall.CLONE_NEWNET}
		cmd.Stdin = strings.NewReader(`{"execute":"qmp_capabilities"}
{"execute":"query-kvm"}
{"execute":"quit"}
`)
		out, err := probeRun(cmd)
		ok := err == nil && strings.Contains(out, `"enabled": true`)
		if own && !ok {
			t.Errorf("jailed QEMU with its own /dev/kvm node: %v: %s", err, out)
		}
		if !own && (ok || !strings.Contains(out, "Permission denied")) {
			t.Errorf("control: /dev/kvm left to root, QEMU: %v: %s", err, out)
		}
		msg := "query-kvm: enabled"
		if !ok {
			msg = firstLine(out)
		}
		t.Logf("/dev/kvm node owned by QEMU's uid: %v: %s", own, msg)
	}
}

// TestUIDKeptWhileAProcessRunsAsIt: a uid whose state dir is gone is not
// reclaimed while a process still runs as it (a QEMU that rewrote its own
// command line passes for gone), and killUID ends every such process.
// Control: once nothing runs as the uid, the same uid is stale.
func TestUIDKeptWhileAProcessRunsAsIt(t *testing.T) {
	testenv.RequireRoot(t, "processes under another uid")
	root := t.TempDir()
	a := uidAlloc{dir: filepath.Join(root, "uids"), base: DefaultUIDBase + DefaultUIDCount - 2, count: 2}
	state := filepath.Join(root, "vm")
	if err := os.Mkdir(state, 0o700); err != nil {
		t.Fatal(err)
	}
	uid, err := a.take(state)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sleep", "100")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	t.Cleanup(func() { _ = cmd.Process.Kill(); <-done })
	if err := os.Remove(state); err != nil {
		t.Fatal(err)
	}
	if a.stale(uid) {
		t.Fatalf("uid %d is stale while pid %d runs as it", uid, cmd.Process.Pid)
	}
	if err := killUID(uid, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	<-done
	if !a.stale(uid) {
		t.Fatalf("control: uid %d not stale once nothing runs as it", uid)
	}
}
