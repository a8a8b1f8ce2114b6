// Package escape is the cross-runtime escape suite: one real node
// (cubelet with network-agent), one sandbox per runtime (runc, gVisor, a
// QEMU micro-VM under TCG unless CUBE_VM_ACCEL says otherwise), and the
// same table of attempts (rows_test.go) run inside each through its
// agent, by a static probe binary carried in the test template
// (./probe). Every row has a control that shows the same probe
// succeeding without the one protection. The test ends with a table of
// rows × runtimes. docs/security.md ("Escape suite") describes it.
package escape

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/testenv"
	"github.com/cubesandbox/cube/internal/vmguest"
)

// Limits the sandboxes get (runc and gVisor; a VM keeps the default RAM).
const (
	memLimitMiB = 256
	pidsLimit   = 256
)

type obs struct {
	Ran     bool
	Escaped bool
	Detail  string
}

type suite struct {
	t        *testing.T
	env      *cubelettest.Env
	net      *nettest.Env
	svc      *cubelet.Service
	w        *nettest.World
	cap      *rawCapture
	probe    string
	hostPort int
	marker   string
	holdPID  int
	keyring  int
	sbs      map[string]*sandbox.Record
	hm       hostMountDirs

	mu    sync.Mutex
	obs   map[string]map[string]obs // row -> runtime
	ctl   map[string]obs            // row -> control (Escaped: the control succeeded)
	netOK map[string]map[string]string
	// fillRoom is what the sandboxes' images can still allocate, summed
	// before the fills.
	fillRoom int64
}

func (s *suite) record(rowName, rt string, escaped bool, format string, a ...any) {
	d := fmt.Sprintf(format, a...)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.obs[rowName] == nil {
		s.obs[rowName] = map[string]obs{}
	}
	s.obs[rowName][rt] = obs{Ran: true, Escaped: escaped, Detail: d}
	word := "blocked"
	if escaped {
		word = "ESCAPED"
	}
	s.t.Logf("[%s] %-14s %s: %s", rt, rowName, word, d)
}

// control records whether the control of a row succeeded; a row may get
// several (one per runtime): all must.
func (s *suite) control(rowName string, ok bool, format string, a ...any) {
	d := fmt.Sprintf(format, a...)
	s.mu.Lock()
	defer s.mu.Unlock()
	c, seen := s.ctl[rowName]
	if !seen {
		c = obs{Ran: true, Escaped: true}
	}
	c.Escaped = c.Escaped && ok
	if c.Detail != "" {
		c.Detail += "; "
	}
	c.Detail += d
	s.ctl[rowName] = c
	word := "control ok"
	if !ok {
		word = "CONTROL FAILED"
	}
	s.t.Logf("[control] %-14s %s: %s", rowName, word, d)
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func TestEscape(t *testing.T) {
	cubelettest.RequireRoot(t)
	testenv.RequireBinary(t, "runsc", "runsc")
	testenv.RequireBinary(t, "qemu-system-x86_64", "qemu-system-x86")
	testenv.RequireBinary(t, "nsenter", "util-linux")
	ctx := context.Background()
	start := time.Now()
	s := &suite{t: t, obs: map[string]map[string]obs{}, ctl: map[string]obs{},
		netOK: map[string]map[string]string{}, sbs: map[string]*sandbox.Record{}}
	dir := t.TempDir()
	s.probe = buildProbe(t, dir)
	image := probeImage(t, s.probe, dir)

	gctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	guest := filepath.Join(vmguest.DefaultCacheDir, "guest-cubelet")
	if _, err := vmguest.Build(gctx, vmguest.BuildConfig{OutDir: guest}); err != nil {
		t.Fatalf("guest artifacts: %v", err)
	}
	accel := os.Getenv("CUBE_VM_ACCEL")
	if accel == "" {
		accel = "tcg"
	}
	s.hm = newHostMountDirs(t)
	s.env = cubelettest.New(t, fmt.Sprintf("[vm]\nguest_dir = %q\naccel = %q\n[sandbox]\nagent_ready_timeout = \"120s\"\n[[storage.host_mount_allow]]\nprefix = %q\n[[storage.host_mount_allow]]\nprefix = %q\nread_only = true\n",
		guest, accel, s.hm.Shared, s.hm.RO))
	// The test world: the internet, a metadata responder, private and
	// closed ranges, UDP echo beside every TCP greeter, a raw capture,
	// DNS names and web servers for the egress rows; and the host's own
	// greeter (every host address) and UDP echo (its end of the world
	// link and every slot gateway, added once the sandboxes have theirs).
	s.w = nettest.NewWorld(t)
	dnsUp := s.egressWorld()
	s.net = s.env.StartNetworkAgent(t, nettest.Options{PoolSize: 2, VMPoolSize: 1, DNSUpstreams: []string{dnsUp.String()}})
	s.svc = s.env.Start(t)
	if _, err := s.svc.ImportTemplate(ctx, "escape", image, nil); err != nil {
		t.Fatalf("import: %v", err)
	}
	meta := s.w.ServeMetadata(t)
	udpEcho(t, s.w.NS, append([]netip.Addr{meta, s.w.Private, s.w.Closed}, s.w.Addrs...), s.w.Port)
	s.hostPort = s.w.Port + 1000
	nettest.ServeIn(t, "", s.hostPort)
	s.cap = newRawCapture(t, s.w.NS)

	// A host process for the ptrace rows to look for.
	s.marker = "escape-marker-" + randHex(4)
	hold := exec.Command(s.probe, "hold", s.marker)
	if err := hold.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = hold.Process.Kill(); _ = hold.Wait() })
	s.holdPID = hold.Process.Pid
	var err error
	if s.keyring, err = unix.KeyctlInt(unix.KEYCTL_GET_KEYRING_ID, unix.KEY_SPEC_USER_KEYRING, 0, 0, 0); err != nil {
		t.Fatalf("host keyring: %v", err)
	}

	s.create(ctx)
	t.Logf("node and sandboxes ready in %v", time.Since(start).Round(time.Millisecond))
	hostAddrs := []netip.Addr{s.w.HostEnd}
	for _, sb := range s.sbs {
		hostAddrs = append(hostAddrs, netip.MustParseAddr(sb.Network.GatewayIP))
	}
	udpEcho(t, "", hostAddrs, s.hostPort)

	// Attempts: every runtime at once (they share nothing the rows
	// change). Rows that touch shared state run after, one at a time.
	poolBefore := poolFree(s.env.Config.PoolDir())
	var wg sync.WaitGroup
	for _, rt := range runtimes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.attempts(ctx, rt)
		}()
	}
	wg.Wait()
	t.Logf("attempts done at %v", time.Since(start).Round(time.Millisecond))
	s.poolCheck(poolBefore)
	s.serialRows(ctx)
	s.controls(ctx)
	t.Logf("controls done at %v", time.Since(start).Round(time.Millisecond))
	// Last: the bombs. A gVisor sandbox does not survive either (the
	// host's OOM killer takes its sentry): the memory bomb gets a fresh
	// one.
	req := cubelet.CreateRequest{SandboxID: "esc-gvisor-2", TemplateID: "escape", Runtime: gvisor,
		Resources: sandbox.Resources{MemoryMiB: memLimitMiB, Pids: pidsLimit}}
	if res, err := s.svc.Create(ctx, req); err != nil {
		t.Errorf("second gvisor sandbox: %v", err)
	} else {
		s.sbs[gvisor2] = res.Sandbox
	}
	for _, rt := range []string{runc, gvisor} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.forkBomb(ctx, rt, s.sbs[rt])
			if rt == gvisor {
				if s.sbs[gvisor2] != nil {
					s.memoryBomb(ctx, gvisor2, gvisor, s.sbs[gvisor2])
				}
				return
			}
			s.memoryBomb(ctx, rt, rt, s.sbs[rt])
		}()
	}
	wg.Wait()
	t.Logf("bombs done at %v", time.Since(start).Round(time.Millisecond))
	s.report()
}

// create starts one sandbox per runtime, all at once (the VM's TCG boot
// is the long pole).
func (s *suite) create(ctx context.Context) {
	t := s.t
	var wg sync.WaitGroup
	var mu sync.Mutex
	errs := map[string]error{}
	for _, rt := range runtimes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req := cubelet.CreateRequest{SandboxID: "esc-" + rt, TemplateID: "escape", Runtime: rt}
			if rt != vm {
				req.Resources = sandbox.Resources{MemoryMiB: memLimitMiB, Pids: pidsLimit}
				req.HostMounts = []sandbox.HostMount{{Source: s.hm.Shared, Destination: "/shared"},
					{Source: s.hm.RO, Destination: "/ro", ReadOnly: true}}
			}
			res, err := s.svc.Create(ctx, req)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs[rt] = err
				return
			}
			s.sbs[rt] = res.Sandbox
		}()
	}
	wg.Wait()
	t.Cleanup(func() {
		for _, sb := range s.sbs {
			if _, err := s.svc.Delete(context.Background(), sb.ID); err != nil {
				t.Errorf("delete %s: %v", sb.ID, err)
			}
		}
	})
	for rt, err := range errs {
		t.Fatalf("create %s sandbox: %v", rt, err)
	}
}

func (s *suite) neighbour(rt string) *sandbox.Record {
	next := map[string]string{runc: gvisor, gvisor: vm, vm: runc}
	return s.sbs[next[rt]]
}

// netSpecs are the probe's targets for a sandbox: every netTargets entry
// over each protocol, plus the internet (the positive control).
func (s *suite) netSpecs(rt string, only ...string) []string {
	sb := s.sbs[rt]
	addrs := map[string]string{
		"host":      netip.AddrPortFrom(s.w.HostEnd, uint16(s.hostPort)).String(),
		"gateway":   netip.AddrPortFrom(netip.MustParseAddr(sb.Network.GatewayIP), uint16(s.hostPort)).String(),
		"neighbour": netip.AddrPortFrom(netip.MustParseAddr(s.neighbour(rt).Network.HostIP), agentproto.Port).String(),
		"metadata":  netip.AddrPortFrom(nettest.MetadataAddr, uint16(s.w.Port)).String(),
		"private":   netip.AddrPortFrom(s.w.Private, uint16(s.w.Port)).String(),
		"node":      netip.AddrPortFrom(s.w.Closed, uint16(s.w.Port)).String(),
		"internet":  netip.AddrPortFrom(s.w.Addrs[1], uint16(s.w.Port)).String(),
	}
	names := only
	if len(names) == 0 {
		names = []string{"internet"}
		for _, tg := range netTargets {
			names = append(names, tg.Name)
		}
	}
	var out []string
	for _, n := range names {
		for _, p := range protocols {
			out = append(out, fmt.Sprintf("%s-%s=%s:%s", n, p, p, addrs[n]))
		}
	}
	return out
}

// exec runs the probe in rt's sandbox. A call whose sandbox dies (its
// runtime's host process is gone) ends at once instead of at timeout: the
// agent's stream would just go quiet.
func (s *suite) exec(ctx context.Context, rt string, timeout time.Duration, onLine func(string), args ...string) (execResult, error) {
	sb := s.sbs[rt]
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	go func() {
		for ctx.Err() == nil {
			if err := syscall.Kill(sb.Container.PID, 0); err != nil {
				cancel(fmt.Errorf("sandbox process %d is gone: %w", sb.Container.PID, err))
				return
			}
			time.Sleep(250 * time.Millisecond)
		}
	}()
	res, err := agentExec(ctx, sb, timeout, onLine, append([]string{ProbePath}, args...)...)
	if c := context.Cause(ctx); c != nil && err != nil {
		err = fmt.Errorf("%w (%w)", err, c)
	}
	return res, err
}

// proc1Marker is the line the probe's proc1-fd1 row writes.
const proc1Marker = "escape suite: a sandbox process writes to its agent's stdout"

// attempts runs the rows that need nothing from the other runtimes.
func (s *suite) attempts(ctx context.Context, rt string) {
	t := s.t
	sb := s.sbs[rt]
	nonce := "esc" + randHex(4) + rt
	rows := []string{"userns", "keyctl", "mount", "bpf", "ptrace-host", "ptrace-agent", "proc1-fd1",
		"proc-sys", "sys", "agent-binary", "raw-spoof", "plant-setuid", "mknod", "ipv6", "ro-bind", "ro-submount"}
	args := append([]string{"rows", "-host-keyring", strconv.Itoa(s.keyring), "-marker", s.marker,
		"-host-pid", strconv.Itoa(s.holdPID), "-world", s.w.Addrs[0].String(), "-port", strconv.Itoa(s.w.Port),
		"-nonce", nonce}, rows...)
	res, err := s.exec(ctx, rt, 2*time.Minute, nil, args...)
	if err != nil {
		t.Errorf("[%s] probe rows: %v (%+v)", rt, err, res)
		return
	}
	got := parseLines(res.Stdout)
	for _, r := range rows {
		l, ok := got[r]
		switch {
		case !ok:
			t.Errorf("[%s] probe printed nothing for %s: %+v", rt, r, res)
		case r == "raw-spoof" && l.Word == "sent":
			arrived := s.cap.arrived(nonce, 2*time.Second)
			s.record(r, rt, len(arrived) > 0, "%s; forged packets that reached the world: %v", l.Detail, arrived)
		case r == "plant-setuid":
			s.plant(rt, l)
		case r == "proc1-fd1" && l.Word == "escaped":
			// A write that lands in /dev/null (gVisor's agent lets go of
			// its console once it listens) is no flood: the host's
			// console file is what must stay out of reach.
			b, err := os.ReadFile(filepath.Join(sb.Container.Bundle, "console.log"))
			reached := err == nil && strings.Contains(string(b), proc1Marker)
			s.record(r, rt, reached, "%s; reached the host's console.log: %v (%v)", l.Detail, reached, err)
		default:
			s.record(r, rt, l.Word == "escaped", "%s", l.Detail)
		}
	}

	res, err = s.exec(ctx, rt, time.Minute, nil, append([]string{"net"}, s.netSpecs(rt)...)...)
	if err != nil {
		t.Errorf("[%s] probe net: %v", rt, err)
		return
	}
	s.netRows(rt, parseLines(res.Stdout))
	s.egress(ctx, rt)
	s.diskFill(ctx, rt, sb)
}

func (s *suite) netRows(rt string, got map[string]line) {
	s.mu.Lock()
	s.netOK[rt] = map[string]string{}
	for _, p := range protocols {
		l := got["internet-"+p]
		if l.Word != "escaped" {
			s.netOK[rt][p] = fmt.Sprintf("the internet is unreachable over %s from here too (%s): silence proves nothing", p, l.Detail)
		}
		s.t.Logf("[%s] internet-%s (the path every network row needs): %s %s", rt, p, l.Word, l.Detail)
	}
	s.mu.Unlock()
	for _, tg := range netTargets {
		for _, p := range protocols {
			name := tg.Name + "-" + p
			l, ok := got[name]
			if !ok {
				s.t.Errorf("[%s] no result for %s", rt, name)
				continue
			}
			s.record(name, rt, l.Word == "escaped", "%s", l.Detail)
		}
	}
}

// plant: the probe planted a setuid copy of itself; the host side tries
// to run it as nobody.
func (s *suite) plant(rt string, l line) {
	if rt == vm {
		s.record("setuid-host", rt, false, "planted inside the guest (%s); the disk is not mounted on the host", l.Detail)
		return
	}
	if l.Word != "escaped" {
		s.record("setuid-host", rt, false, "could not plant: %s", l.Detail)
		return
	}
	p := filepath.Join(s.sbs[rt].Mount.Target, "escape-suid")
	out, err := runAsNobody(p, "euid")
	s.record("setuid-host", rt, err == nil, "%s; nobody runs %s: %q %v", l.Detail, p, strings.TrimSpace(out), err)
}

func runAsNobody(path string, args ...string) (string, error) {
	cmd := exec.Command(path, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func (s *suite) forkBomb(ctx context.Context, rt string, sb *sandbox.Record) {
	before, _ := cgroupFile(sb.Container.CgroupPath, "pids", "pids.events")
	res, err := s.exec(ctx, rt, time.Minute, nil, "forkbomb", strconv.Itoa(pidsLimit+64))
	if err != nil {
		s.record("fork-bomb", rt, false, "the sandbox stopped answering: %v", err)
		return
	}
	l := parseLines(res.Stdout)["forkbomb"]
	n, _ := strconv.Atoi(l.Word)
	after, cerr := cgroupFile(sb.Container.CgroupPath, "pids", "pids.events")
	maxBefore, maxAfter := field(before, "max"), field(after, "max")
	s.record("fork-bomb", rt, n >= pidsLimit, "started %d processes (limit %d), then %s; host pids.events max %d -> %d %v",
		n, pidsLimit, l.Detail, maxBefore, maxAfter, cerr)
	if rt == runc {
		s.control("fork-bomb", n >= pidsLimit-32 && maxAfter > maxBefore,
			"%s: the probe forked up to the limit (%d of %d) and the host cgroup refused (pids.events max %d -> %d)", rt, n, pidsLimit, maxBefore, maxAfter)
	}
}

// memoryBomb runs in sandbox key (of runtime rt).
func (s *suite) memoryBomb(ctx context.Context, key, rt string, sb *sandbox.Record) {
	// Control first: the same probe, under the limit, completes.
	res, err := s.exec(ctx, key, time.Minute, nil, "membomb", "64")
	done := err == nil && strings.Contains(res.Stdout, "membomb\tdone\t64")
	s.control("memory-bomb", done, "%s: 64 MiB under the %d MiB limit: done=%v %v", rt, memLimitMiB, done, err)

	before, _ := cgroupFile(sb.Container.CgroupPath, "memory", "memory.oom_control")
	// A gVisor sandbox does not survive this one: the host's OOM killer
	// takes the sentry, and the agent call never ends (hence the short
	// timeout).
	res, err = s.exec(ctx, key, 30*time.Second, nil, "membomb", "1024")
	if err != nil && res.Stdout == "" {
		s.record("memory-bomb", rt, false, "the sandbox stopped answering: %v", err)
		return
	}
	after, _ := cgroupFile(sb.Container.CgroupPath, "memory", "memory.oom_control")
	swap, _ := cgroupFile(sb.Container.CgroupPath, "memory", "memory.memsw.limit_in_bytes")
	limit, _ := cgroupFile(sb.Container.CgroupPath, "memory", "memory.limit_in_bytes")
	lines := strings.Split(strings.TrimSpace(res.Stdout), "\n")
	last := lines[len(lines)-1]
	s.record("memory-bomb", rt, strings.Contains(res.Stdout, "membomb\tdone"),
		"last progress %q, end %q %v; host oom_kill %d -> %d; memory.limit %s, memsw.limit %s",
		last, res.Status, err, field(before, "oom_kill"), field(after, "oom_kill"), limit, swap)
}

func allocated(path string) (size, alloc int64, err error) {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return 0, 0, err
	}
	return st.Size, st.Blocks * 512, nil
}

func poolFree(dir string) int64 {
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		return -1
	}
	return int64(st.Bavail) * st.Bsize
}

// poolCheck: every disk fill together cost the host pool at most what
// the sandboxes' images could still allocate (their size less what they
// held before): nothing a sandbox writes lands anywhere else.
func (s *suite) poolCheck(before int64) {
	after := poolFree(s.env.Config.PoolDir())
	s.mu.Lock()
	room := s.fillRoom
	s.mu.Unlock()
	if lost := before - after; lost > room {
		s.t.Errorf("disk-fill: the pool lost %d MiB to the fills, more than the %d MiB the images had left", lost>>20, room>>20)
	} else {
		s.t.Logf("disk-fill: the pool lost %d MiB to the fills, at most the %d MiB the images had left", lost>>20, room>>20)
	}
}

func (s *suite) diskFill(ctx context.Context, rt string, sb *sandbox.Record) {
	size, before, err := allocated(sb.Disk.Path)
	if err != nil {
		s.t.Errorf("[%s] disk image: %v", rt, err)
		return
	}
	s.mu.Lock()
	s.fillRoom += size - before
	s.mu.Unlock()
	res, err := s.exec(ctx, rt, 3*time.Minute, nil, "fill", "/root/escape-fill")
	if err != nil {
		s.t.Errorf("[%s] fill: %v", rt, err)
		return
	}
	l := parseLines(res.Stdout)["fill"]
	written, _ := strconv.ParseInt(l.Word, 10, 64)
	_, after, _ := allocated(sb.Disk.Path)
	full := strings.Contains(l.Detail, "no space left")
	s.record("disk-fill", rt, !full || after > size,
		"wrote %d MiB, then %q; the image holds %d MiB of its %d MiB on the host (was %d MiB)",
		written>>20, l.Detail, after>>20, size>>20, before>>20)
	s.control("disk-fill", after-before >= written/2,
		"%s: the image's host allocation grew by %d MiB for %d MiB written", rt, (after-before)>>20, written>>20)
	if _, err := agentExec(ctx, sb, time.Minute, nil, "/bin/rm", "-f", "/root/escape-fill"); err != nil {
		s.t.Errorf("[%s] rm fill: %v", rt, err)
	}
}

// serialRows run one runtime at a time: they change or exhaust something
// the host shares.
func (s *suite) serialRows(ctx context.Context) {
	for _, rt := range []string{runc, gvisor} {
		s.inotify(ctx, rt)
		s.symlinkSwap(ctx, rt)
	}
	s.record("symlink-swap", vm, false, "not run: %s", expectOf("symlink-swap", vm).NA)
	s.record("inotify", vm, false, "not run: %s", expectOf("inotify", vm).NA)
	s.inotifyControl()
	for _, r := range []string{"fork-bomb", "memory-bomb"} {
		s.record(r, vm, false, "not run: %s", expectOf(r, vm).NA)
	}
}

func hostInotify() error {
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC)
	if err == nil {
		unix.Close(fd)
	}
	return err
}

// inotifyCap bounds the probe: enough to show a per-sandbox limit, not
// so many that the kernel memory of the instances matters.
const inotifyCap = 8192

func hostMaxInotify() int {
	b, _ := os.ReadFile("/proc/sys/fs/inotify/max_user_instances")
	n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return n
}

// inotify: the sandbox takes instances until refused (at most
// inotifyCap) and holds them while host root asks for one. An escape is
// host root refused, or the sandbox reaching the host's own per-user
// ceiling (it could starve the host's root, who shares that count when
// there is no user namespace). The control: the same probe on the host
// gets that many.
func (s *suite) inotify(ctx context.Context, rt string) {
	ceiling := min(hostMaxInotify(), inotifyCap)
	var hostErr error
	count := -1
	detail := ""
	res, err := s.exec(ctx, rt, time.Minute, func(l string) {
		if f := strings.SplitN(l, "\t", 3); len(f) == 3 && f[0] == "inotify" {
			count, _ = strconv.Atoi(f[1])
			detail = f[2]
			hostErr = hostInotify()
		}
	}, "inotify", strconv.Itoa(inotifyCap), "1")
	if err != nil || count < 0 {
		s.t.Errorf("[%s] inotify: %v %+v", rt, err, res)
		return
	}
	s.record("inotify", rt, hostErr != nil || count >= ceiling,
		"the sandbox got %d instances (then %s; host ceiling %d, probe cap %d); host root's inotify_init1 meanwhile: %v",
		count, detail, hostMaxInotify(), inotifyCap, hostErr)
}

func (s *suite) inotifyControl() {
	ceiling := min(hostMaxInotify(), inotifyCap)
	out, err := hostProbe(s.probe, nil, "inotify", strconv.Itoa(inotifyCap), "0")
	l := parseLines(out)["inotify"]
	n, _ := strconv.Atoi(l.Word)
	s.control("inotify", err == nil && n >= ceiling, "host root's probe got %d instances (%s), ceiling %d %v", n, l.Detail, ceiling, err)
}

func expectOf(rowName, rt string) expect {
	for _, r := range table {
		if r.Name == rowName {
			return r.Expect[rt]
		}
	}
	return expect{}
}

// cell is a row's outcome in one runtime.
func (s *suite) cell(r row, rt string) (string, bool) {
	e := r.Expect[rt]
	o := s.obs[r.Name][rt]
	switch {
	case e.NA != "":
		return "n.a.", true
	case !o.Ran:
		return "FAIL(not run)", false
	}
	if strings.HasPrefix(r.Name, "egress-") && s.netOK[rt]["egress"] != "" {
		return "FAIL(no path)", false
	}
	if strings.Contains(r.Name, "-") {
		tg, proto, _ := strings.Cut(r.Name, "-")
		for _, n := range netTargets {
			if n.Name == tg && s.netOK[rt][proto] != "" {
				return "FAIL(no path)", false
			}
		}
	}
	switch {
	case !o.Escaped && e.Pending != "":
		return "pass(drop pending:" + e.Pending + ")", true
	case !o.Escaped:
		return "pass", true
	case e.Pending != "":
		return "pending:" + e.Pending, true
	}
	return "FAIL", false
}

// report prints the table and fails the test for every failed cell or
// control.
func (s *suite) report() {
	t := s.t
	var b strings.Builder
	fmt.Fprintf(&b, "\n%-19s %-22s %-22s %-22s %s\n", "row", runc, gvisor, vm, "control")
	var failed []string
	for _, r := range table {
		fmt.Fprintf(&b, "%-19s", r.Name)
		for _, rt := range runtimes {
			c, ok := s.cell(r, rt)
			if !ok {
				failed = append(failed, fmt.Sprintf("%s/%s: %s (%s)", r.Name, rt, c, s.obs[r.Name][rt].Detail))
			}
			fmt.Fprintf(&b, " %-22s", c)
		}
		c := s.ctl[r.Name]
		switch {
		case !c.Ran:
			fmt.Fprintf(&b, " MISSING")
			failed = append(failed, r.Name+": no control ran")
		case !c.Escaped:
			fmt.Fprintf(&b, " FAILED")
			failed = append(failed, fmt.Sprintf("%s: control failed: %s", r.Name, c.Detail))
		default:
			fmt.Fprintf(&b, " ok")
		}
		b.WriteString("\n")
	}
	t.Log(b.String())
	sort.Strings(failed)
	for _, f := range failed {
		t.Error(f)
	}
}
