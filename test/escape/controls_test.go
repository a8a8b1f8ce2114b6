package escape

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/google/nftables"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/netnsdir"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/network/nft"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// controls runs every row's control: the same probe where the one
// protection is absent must succeed.
func (s *suite) controls(ctx context.Context) {
	s.hostControls()
	s.rawSpoofControl(ctx)
	s.ipv6Control(ctx)
	s.netControl(ctx)
	s.egressControl(ctx)
	s.setuidControls()
}

// hostControls run the probe on the host as root: no namespace, no
// capability bounding, no read-only mount in the way.
func (s *suite) hostControls() {
	tmp, err := os.MkdirTemp("", "escape-ctl-")
	if err != nil {
		s.t.Fatal(err)
	}
	defer os.RemoveAll(tmp)
	run := func(attr *syscall.SysProcAttr, args ...string) map[string]line {
		out, err := hostProbe(s.probe, attr, args...)
		if err != nil {
			s.t.Errorf("host probe %v: %v\n%s", args, err, out)
		}
		return parseLines(out)
	}
	got := run(nil, "rows", "-host-keyring", strconv.Itoa(s.keyring), "-marker", s.marker, "-host-pid", strconv.Itoa(s.holdPID),
		"-fd-pid", strconv.Itoa(s.holdPID), "-agent", s.env.AgentBin, "-plant", filepath.Join(tmp, "x"),
		"userns", "keyctl", "bpf", "ptrace-host", "proc1-fd1", "proc-sys", "sys", "agent-binary", "mknod")
	// The mount probe needs a mount namespace of its own (Go's
	// Unshareflags make its mounts private first).
	for k, v := range run(&syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}, "rows", "mount") {
		got[k] = v
	}
	for _, r := range []string{"userns", "keyctl", "mount", "bpf", "ptrace-host", "proc1-fd1", "proc-sys", "sys", "agent-binary", "mknod"} {
		l := got[r]
		s.control(r, l.Word == "escaped", "host root: %s", l.Detail)
	}
	for _, r := range []struct{ row, path string }{{"ro-bind", s.hm.RO}, {"ro-submount", filepath.Join(s.hm.RO, "sub")}} {
		p := filepath.Join(r.path, "escape-ctl")
		err := os.WriteFile(p, nil, 0o644)
		s.control(r.row, err == nil, "host root creates %s: %v", p, err)
		_ = os.Remove(p)
	}
	l := got["ptrace-host"]
	s.control("ptrace-agent", l.Word == "escaped", "host root attaching a dumpable process of its uid: %s", l.Detail)
}

// rawSpoofControl sends from the runc sandbox's namespace as host root
// (which has CAP_NET_RAW): its own source arrives, and a forged one
// arrives once the slot's anti-spoofing rule is deleted.
func (s *suite) rawSpoofControl(ctx context.Context) {
	sb := s.sbs[runc]
	send := func(src string) map[string]string {
		nonce := "ctl" + randHex(4)
		out, err := hostProbe("nsenter", nil, "--net="+sb.Network.NetNS, s.probe, "rows", "-world", s.w.Addrs[0].String(),
			"-port", strconv.Itoa(s.w.Port), "-nonce", nonce, "-spoof-src", src, "raw-spoof")
		if err != nil {
			s.t.Errorf("raw-spoof control: %v\n%s", err, out)
		}
		return s.cap.arrived(nonce, 2*time.Second)
	}
	own := send(network.SandboxIP.String())
	s.control("raw-spoof", len(own) == 3, "own source from the sandbox netns with CAP_NET_RAW arrived: %v", own)
	if err := netnsdir.Do(sb.Network.SlotNetNS, nettest.DeleteAntiSpoofRule); err != nil {
		s.t.Errorf("delete anti-spoofing rule: %v", err)
	}
	forged := send(nettest.ForgedSource.String())
	s.control("raw-spoof", len(forged) == 3, "forged source with the anti-spoofing rule deleted arrived: %v", forged)
	s.restoreSlot(ctx)
}

// restoreSlot re-applies the runc slot's rules and the host table.
func (s *suite) restoreSlot(ctx context.Context) {
	if _, err := s.net.Agent.UpdatePolicy(ctx, s.sbs[runc].ID, nil); err != nil {
		s.t.Errorf("re-apply slot rules: %v", err)
	}
	c := s.net.Config
	if err := nft.ApplyHost(nft.Host{Table: c.Prefix, LinkPrefix: c.Prefix + "-", NodeCIDR: c.CIDR()}); err != nil {
		s.t.Errorf("re-apply host table: %v", err)
	}
}

// ipv6Control opens an IPv6 path on purpose: IPv6 on in the runc
// sandbox's namespace and its slot, the slot's ip6 table gone. The same
// probe then gets an answer (from the slot's link-local address).
func (s *suite) ipv6Control(ctx context.Context) {
	sb := s.sbs[runc]
	on := []string{"ipv6/conf/all/accept_dad", "0", "ipv6/conf/default/accept_dad", "0",
		"ipv6/conf/all/disable_ipv6", "0", "ipv6/conf/default/disable_ipv6", "0"}
	var errs []error
	for _, ns := range []string{sb.Network.NetNS, sb.Network.SlotNetNS} {
		errs = append(errs, netnsdir.Sysctl(ns, on...))
	}
	errs = append(errs, netnsdir.Do(sb.Network.SlotNetNS, func() error { return nft.DeleteTable6(-1, nft.SlotTable) }))
	if err := errors.Join(errs...); err != nil {
		s.t.Errorf("open an IPv6 path: %v", err)
	}
	var l line
	for try := 0; try < 10; try++ { // link-local addresses come up
		res, err := s.exec(ctx, runc, time.Minute, nil, "rows", "ipv6")
		if err != nil {
			s.t.Errorf("ipv6 control: %v", err)
			break
		}
		if l = parseLines(res.Stdout)["ipv6"]; l.Word == "escaped" {
			break
		}
		time.Sleep(300 * time.Millisecond)
	}
	s.control("ipv6", l.Word == "escaped", "runc sandbox with IPv6 enabled and the slot's ip6 table removed: %s", l.Detail)
	off := []string{"ipv6/conf/all/disable_ipv6", "1", "ipv6/conf/default/disable_ipv6", "1"}
	if err := netnsdir.Sysctl(sb.Network.NetNS, off...); err != nil {
		s.t.Errorf("ipv6 off: %v", err)
	}
	s.restoreSlot(ctx)
}

// netControl removes the rules that stop the network rows: the runc
// slot's blocked and private sets are flushed, the host table goes, and
// so do the neighbour's slot tables (its slot accepts new connections
// from its own gateway only). The same probe then reaches every target:
// the neighbour's slot itself answers (a refusal or an echo reply).
func (s *suite) netControl(ctx context.Context) {
	sb, nb := s.sbs[runc], s.neighbour(runc)
	err := netnsdir.Do(sb.Network.SlotNetNS, func() error {
		c, err := nftables.New()
		if err != nil {
			return err
		}
		t := &nftables.Table{Family: nftables.TableFamilyIPv4, Name: nft.SlotTable}
		for _, name := range []string{"blocked", "private"} {
			c.FlushSet(&nftables.Set{Table: t, Name: name})
		}
		return c.Flush()
	})
	if err == nil {
		err = nft.DeleteTable(-1, s.net.Config.Prefix)
	}
	if err == nil {
		err = netnsdir.Do(nb.Network.SlotNetNS, func() error { return nft.DeleteTable(-1, nft.SlotTable) })
	}
	if err != nil {
		s.t.Errorf("remove the network rules: %v", err)
	}
	var names []string
	for _, tg := range netTargets {
		names = append(names, tg.Name)
	}
	res, err := s.exec(ctx, runc, time.Minute, nil, append([]string{"net"}, s.netSpecs(runc, names...)...)...)
	if err != nil {
		s.t.Errorf("net control: %v", err)
	}
	got := parseLines(res.Stdout)
	s.restoreSlot(ctx)
	if _, err := s.net.Agent.UpdatePolicy(ctx, nb.ID, nil); err != nil {
		s.t.Errorf("re-apply the neighbour's slot rules: %v", err)
	}
	for _, n := range names {
		for _, p := range protocols {
			l := got[n+"-"+p]
			s.control(n+"-"+p, l.Word == "escaped", "runc, rules removed: %s", l.Detail)
		}
	}
	// And after the restore the rules hold again.
	res, err = s.exec(ctx, runc, time.Minute, nil, append([]string{"net"}, s.netSpecs(runc, "metadata", "host", "neighbour")...)...)
	if err != nil {
		s.t.Errorf("net after restore: %v", err)
	}
	for k, l := range parseLines(res.Stdout) {
		if l.Word != "blocked" {
			s.t.Errorf("after the rules were restored %s: %s", k, l.Detail)
		}
	}
}

// setuidControls loosen the run directory that keeps nobody out: nobody
// then reaches the planted file (setuid-host's control), and what euid
// it gets says whether the rootfs mount is nosuid (the nosuid row). The
// nosuid row's own control runs the same file from a host directory
// without nosuid.
func (s *suite) setuidControls() {
	dir := filepath.Join(s.env.Config.Node.RunDir, "sandboxes")
	if err := os.Chmod(dir, 0o711); err != nil {
		s.t.Fatal(err)
	}
	defer func() {
		if err := os.Chmod(dir, 0o700); err != nil {
			s.t.Error(err)
		}
	}()
	var planted string
	for _, rt := range []string{runc, gvisor} {
		root := s.sbs[rt].Mount.Target
		p := filepath.Join(root, "escape-suid")
		out, err := runAsNobody("/bin/head", "-c", "4", p)
		s.control("setuid-host", err == nil, "%s: run directory at 0711, nobody reads %s: %q %v", rt, p, out, err)
		if err != nil {
			s.record("nosuid", rt, false, "nobody cannot reach it even through a loosened directory: %v", err)
			continue
		}
		planted = p
		out, err = runAsNobody(p, "euid")
		euid := strings.TrimSpace(out)
		if err == nil {
			s.record("nosuid", rt, euid == "0", "nobody ran the planted setuid file: euid %s", euid)
			continue
		}
		// gVisor's gofer may still hold the file open for writing
		// (ETXTBSY): then what decides is whether the file kept its
		// setuid bit on the host and the mount lets it work.
		var st syscall.Stat_t
		serr := syscall.Stat(p, &st)
		opts := mountOptions(root)
		open := serr == nil && st.Mode&syscall.S_ISUID != 0 && !strings.Contains(opts, "nosuid")
		s.record("nosuid", rt, open, "nobody cannot exec it (%v); on the host its mode is %o, the rootfs mount %q", err, st.Mode, opts)
	}
	s.record("nosuid", vm, false, "not run: %s", expectOf("nosuid", vm).NA)
	if planted == "" {
		s.control("nosuid", false, "nothing planted to copy")
		return
	}
	tmp, err := os.MkdirTemp("", "escape-suid-")
	if err != nil {
		s.t.Fatal(err)
	}
	defer os.RemoveAll(tmp)
	_ = os.Chmod(tmp, 0o755)
	data, err := os.ReadFile(planted)
	cp := filepath.Join(tmp, "suid")
	if err == nil {
		err = os.WriteFile(cp, data, 0o755)
	}
	if err == nil {
		err = os.Chmod(cp, os.ModeSetuid|0o755) // os.Chmod ignores 0o4000
	}
	out, rerr := runAsNobody(cp, "euid")
	s.control("nosuid", err == nil && rerr == nil && strings.TrimSpace(out) == "0",
		"the same file in a host directory without nosuid: euid %q %v %v", strings.TrimSpace(out), err, rerr)
}

// mountOptions returns the per-mount options of the mount at target.
func mountOptions(target string) string {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return fmt.Sprint(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 5 && f[4] == target {
			return f[5]
		}
	}
	return "not mounted"
}

// hostMountDirs are the host side of the symlink-swap row: a directory
// the node allows sandboxes to bind (each runtime's sandbox gets it
// read-write at /shared), and a secret outside it.
type hostMountDirs struct {
	Shared, Secret, Nonce string
	// RO is bound read-only at /ro; a tmpfs is mounted at RO/sub on the
	// host, so a bind that is read-only only at its top leaves it writable.
	RO string
}

func newHostMountDirs(t interface {
	Fatal(...any)
	Cleanup(func())
}) hostMountDirs {
	base, err := os.MkdirTemp("", "escape-hm-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	d := hostMountDirs{Shared: filepath.Join(base, "shared"), Secret: filepath.Join(base, "secret"), Nonce: "secret-" + randHex(8),
		RO: filepath.Join(base, "ro")}
	for _, p := range []string{d.Shared, d.Secret, filepath.Join(d.RO, "sub")} {
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	sub := filepath.Join(d.RO, "sub")
	if err := syscall.Mount("escape-ro", sub, "tmpfs", syscall.MS_NOSUID|syscall.MS_NODEV, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Unmount(sub, syscall.MNT_DETACH) })
	if err := os.WriteFile(filepath.Join(d.Secret, "flag"), []byte(d.Nonce), 0o644); err != nil {
		t.Fatal(err)
	}
	return d
}

// symlinkSwap: sandbox A (rw bind of the shared directory) swaps a
// directory for a symlink to the secret after cubelet checked sandbox B's
// bind source at B's create request and before B's container is made (a
// failpoint holds B's create for 3 s before its container step, where
// the disk and rootfs steps otherwise take that time). Bound by the name
// checked at the request, B would get the secret.
func (s *suite) symlinkSwap(ctx context.Context, rt string) {
	sub := filepath.Join(s.hm.Shared, rt, "sub")
	if err := os.MkdirAll(sub, 0o755); err != nil {
		s.t.Fatal(err)
	}
	// Writable by whatever host uid the sandbox's root is (a user
	// namespace maps it away from 0): the attack needs a read-write mount
	// the sandbox can actually write, which is what an operator grants.
	for _, d := range []string{s.hm.Shared, filepath.Dir(sub)} {
		if err := os.Chmod(d, 0o777); err != nil {
			s.t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(sub, "flag"), []byte("legit"), 0o644); err != nil {
		s.t.Fatal(err)
	}
	if err := failpoint.Enable("create/container", "1*sleep(3s)"); err != nil {
		s.t.Fatal(err)
	}
	defer failpoint.Disable("create/container")
	id := "esc-" + rt + "-swap"
	type created struct {
		sb  *sandbox.Record
		err error
	}
	done := make(chan created, 1)
	go func() {
		res, err := s.svc.Create(ctx, cubelet.CreateRequest{SandboxID: id, TemplateID: "escape", Runtime: rt,
			HostMounts: []sandbox.HostMount{{Source: sub, Destination: "/data", ReadOnly: true}}})
		if err != nil {
			done <- created{err: err}
			return
		}
		done <- created{sb: res.Sandbox}
	}()
	// The record exists once the request's checks passed.
	for deadline := time.Now().Add(20 * time.Second); ; {
		if _, err := s.svc.Get(ctx, id); err == nil {
			break
		}
		if time.Now().After(deadline) {
			s.t.Errorf("[%s] symlink-swap: sandbox %s never recorded", rt, id)
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	res, err := s.exec(ctx, rt, time.Minute, nil, "swap", filepath.Join("/shared", rt, "sub"), s.hm.Secret)
	swapped := parseLines(res.Stdout)["swap"]
	c := <-done
	if c.sb != nil {
		defer func() {
			if _, err := s.svc.Delete(ctx, id); err != nil {
				s.t.Errorf("delete %s: %v", id, err)
			}
		}()
	}
	switch {
	case err != nil || swapped.Word != "escaped":
		s.t.Errorf("[%s] symlink-swap: the sandbox could not swap: %v %+v", rt, err, res)
	case c.err != nil:
		s.record("symlink-swap", rt, false, "swapped %s; the create failed: %v", swapped.Detail, c.err)
	default:
		out, err := agentExec(ctx, c.sb, time.Minute, nil, "/bin/cat", "/data/flag")
		got := strings.TrimSpace(out.Stdout)
		s.record("symlink-swap", rt, got == s.hm.Nonce, "swapped %s during the create; the new sandbox's /data/flag: %q %v", swapped.Detail, got, err)
	}
	// Control: by name, the checked path now leads to the secret.
	b, err := os.ReadFile(filepath.Join(sub, "flag"))
	s.control("symlink-swap", err == nil && string(b) == s.hm.Nonce, "%s: host path %s now reads %q (%v): a bind by name gets the secret", rt, sub, b, err)
}
