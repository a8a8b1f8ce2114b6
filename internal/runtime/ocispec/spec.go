// Package ocispec builds the OCI runtime spec (config.json) of a sandbox
// from a runtime.Spec: namespaces, mounts, capabilities, no_new_privs, the
// seccomp filter (seccomp.go), masked paths, device rules and cgroup
// limits. The OCI drivers (runc, gvisor) write
// what For returns, gvisor after its own adjustments. Building is pure
// (no host access), so the output is pinned by golden files; a driver
// fits the result to the host at Start.
package ocispec

import (
	"fmt"
	"maps"
	"path"
	"path/filepath"
	"slices"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime"
)

const (
	// cfsPeriod is the CFS period every sandbox gets; MilliCPU scales the
	// quota against it. 100ms is the kernel default, so throttling behaves
	// the way users expect from docker --cpus.
	cfsPeriod uint64 = 100000
	// nofile matches containerd/docker: language runtimes and dev servers
	// inside a sandbox open many files, and the kernel's nr_open default
	// caps it here anyway.
	nofile uint64 = 1048576
	// defaultCgroupParent holds sandboxes whose Spec names no cgroup, so
	// they never land at the hierarchy root.
	defaultCgroupParent = "/cube"
)

// defaultCaps is containerd's default set less CAP_MKNOD and CAP_NET_RAW.
// Each one that stays, and who needs it:
//
//   - CHOWN, DAC_OVERRIDE, FOWNER, FSETID: root in the sandbox owns the
//     sandbox's files (E2B's user "root"; package managers): chown, write
//     and chmod anything, keep setgid bits on files it changes. The agent
//     writes files as the requesting user (setfsuid), not through these.
//   - SETUID, SETGID: the agent starts commands as other users, and su,
//     runuser or a server dropping to its own account do the same.
//   - SETPCAP: a process drops capabilities from its bounding set (the
//     agent does, where a runtime grants it CAP_SYS_ADMIN; setpriv, capsh).
//   - SETFCAP: package installs write file capabilities (dpkg postinst
//     setcap, tar --xattrs). Such a file grants nothing at exec: the
//     bounding set caps it and no_new_privs ignores file capabilities.
//   - KILL: root signals processes of other users (the agent's kill and
//     signal requests, a user's own kill as root).
//   - NET_BIND_SERVICE: root servers bind ports below 1024, in the
//     sandbox's own network namespace only.
//   - SYS_CHROOT: build tools and package scripts chroot; inside the
//     sandbox's mount namespace a chroot reaches nothing new.
//   - AUDIT_WRITE: su, login and sshd running as root treat an EPERM from
//     the audit socket as fatal (libpam, OpenSSH). What it allows is
//     writing user-type records into the host's audit log.
//
// Out on purpose: CAP_SYS_ADMIN (mount, and a long reach into the host
// kernel); CAP_NET_RAW (forged packets, sniffing; ping works without it
// through ICMP datagram sockets, see the runc driver's ping_group_range);
// CAP_MKNOD (device nodes a sandbox never needs); every other capability
// (SYS_PTRACE, SYS_MODULE, SYS_TIME, NET_ADMIN, BPF, PERFMON, ...).
var defaultCaps = []string{
	"CAP_CHOWN",
	"CAP_DAC_OVERRIDE",
	"CAP_FSETID",
	"CAP_FOWNER",
	"CAP_SETGID",
	"CAP_SETUID",
	"CAP_SETFCAP",
	"CAP_SETPCAP",
	"CAP_NET_BIND_SERVICE",
	"CAP_SYS_CHROOT",
	"CAP_KILL",
	"CAP_AUDIT_WRITE",
}

// maskedPaths and readonlyPaths are containerd's and Docker's defaults:
// kernel interfaces that leak host information or allow host-wide
// changes. Masked files read as empty (/dev/null over them), masked
// directories as an empty read-only tmpfs (the runc driver binds an
// empty directory over them instead: bindMaskedDirs under /sys,
// lateMounts under /proc).
// /proc/interrupts is masked because per-CPU interrupt counts of the
// host's devices are a timing side channel (keystrokes, network activity
// of neighbours). /sys is mounted read-only as a whole (mountsFor).
var (
	maskedPaths = []string{
		"/proc/acpi",
		"/proc/asound",
		"/proc/interrupts",
		"/proc/kcore",
		"/proc/keys",
		"/proc/latency_stats",
		"/proc/timer_list",
		"/proc/timer_stats",
		"/proc/sched_debug",
		"/proc/scsi",
		"/sys/firmware",
		"/sys/devices/virtual/powercap",
	}
	readonlyPaths = []string{
		"/proc/bus",
		"/proc/fs",
		"/proc/irq",
		"/proc/sys",
		"/proc/sysrq-trigger",
	}
)

// For turns a runtime.Spec into the OCI runtime spec runc and runsc consume. It is
// pure (no host access) so that its output can be pinned by golden files.
// An invalid Spec is an error wrapping errdefs.ErrInvalidArgument.
func For(s runtime.Spec) (*specs.Spec, error) {
	if err := validate(s); err != nil {
		return nil, err
	}
	cwd := s.Cwd
	if cwd == "" {
		cwd = "/"
	}
	hostname := s.Hostname
	if hostname == "" {
		hostname = s.ID
	}

	env := slices.Clone(s.Env)
	if !slices.ContainsFunc(env, func(kv string) bool { return strings.HasPrefix(kv, "GOMAXPROCS=") }) {
		env = append(env, "GOMAXPROCS="+agentproto.AgentGOMAXPROCS, agentproto.AgentOnlyEnv+"=GOMAXPROCS")
	}
	if s.AgentTokenHash != "" {
		env = append(env, agentproto.TokenHashEnv+"="+s.AgentTokenHash)
	}
	if s.Resolver != "" {
		env = append(env, agentproto.ResolverEnv+"="+s.Resolver)
	}
	if len(s.EgressCA) > 0 {
		env = append(env, agentproto.EgressCAEnv+"="+agentproto.EncodeCA(s.EgressCA))
	}
	sp := &specs.Spec{
		Version: specs.Version,
		Process: &specs.Process{
			Terminal: false,
			User:     specs.User{UID: 0, GID: 0},
			Args:     slices.Clone(s.Args),
			Env:      env,
			Cwd:      cwd,
			Capabilities: &specs.LinuxCapabilities{
				Bounding:  slices.Clone(defaultCaps),
				Effective: slices.Clone(defaultCaps),
				Permitted: slices.Clone(defaultCaps),
			},
			Rlimits: []specs.POSIXRlimit{{Type: "RLIMIT_NOFILE", Hard: nofile, Soft: nofile}},
			// No process in the sandbox gains privileges at exec: setuid
			// and setgid bits and file capabilities are ignored, so sudo
			// and su cannot raise a user to root. Root commands go
			// through the API's user "root" (the agent switches itself).
			// It also lets runc install the seccomp filter as late as
			// possible, right before PID 1's exec.
			NoNewPrivileges: true,
		},
		Root:        &specs.Root{Path: s.RootFS, Readonly: false},
		Hostname:    hostname,
		Mounts:      mountsFor(s.Mounts),
		Annotations: maps.Clone(s.Labels),
		Linux: &specs.Linux{
			CgroupsPath: cgroupPathFor(s),
			Resources:   resourcesFor(s.Limits),
			Namespaces: []specs.LinuxNamespace{
				{Type: specs.PIDNamespace},
				{Type: specs.IPCNamespace},
				{Type: specs.UTSNamespace},
				{Type: specs.MountNamespace},
				{Type: specs.CgroupNamespace},
				{Type: specs.NetworkNamespace, Path: s.NetNSPath},
			},
			MaskedPaths:   slices.Clone(maskedPaths),
			ReadonlyPaths: slices.Clone(readonlyPaths),
			Seccomp:       seccompProfile(hostArch),
		},
	}
	return sp, nil
}

func validate(s runtime.Spec) error {
	switch {
	case s.ID == "":
		return fmt.Errorf("spec: empty ID: %w", errdefs.ErrInvalidArgument)
	case len(s.Args) == 0:
		return fmt.Errorf("spec %q: no Args: %w", s.ID, errdefs.ErrInvalidArgument)
	case !filepath.IsAbs(s.RootFS):
		return fmt.Errorf("spec %q: RootFS %q is not absolute: %w", s.ID, s.RootFS, errdefs.ErrInvalidArgument)
	case s.CgroupPath != "" && !path.IsAbs(s.CgroupPath):
		// runc resolves relative paths against its own cgroup, which
		// differs between cubelet restarts; Stop could not find it again.
		return fmt.Errorf("spec %q: CgroupPath %q is not absolute: %w", s.ID, s.CgroupPath, errdefs.ErrInvalidArgument)
	}
	for _, m := range s.Mounts {
		if !filepath.IsAbs(m.Source) || !path.IsAbs(m.Destination) {
			return fmt.Errorf("spec %q: mount %q->%q must be absolute: %w", s.ID, m.Source, m.Destination, errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

func cgroupPathFor(s runtime.Spec) string {
	if s.CgroupPath != "" {
		return path.Clean(s.CgroupPath)
	}
	return path.Join(defaultCgroupParent, s.ID)
}

func mountsFor(extra []runtime.Mount) []specs.Mount {
	ms := []specs.Mount{
		{Destination: "/proc", Type: "proc", Source: "proc", Options: []string{"nosuid", "noexec", "nodev"}},
		{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
		{Destination: "/dev/pts", Type: "devpts", Source: "devpts", Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"}},
		{Destination: "/dev/shm", Type: "tmpfs", Source: "shm", Options: []string{"nosuid", "noexec", "nodev", "mode=1777", "size=65536k"}},
		{Destination: "/dev/mqueue", Type: "mqueue", Source: "mqueue", Options: []string{"nosuid", "noexec", "nodev"}},
		{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: []string{"nosuid", "noexec", "nodev", "ro"}},
		{Destination: "/sys/fs/cgroup", Type: "cgroup", Source: "cgroup", Options: []string{"nosuid", "noexec", "nodev", "relatime", "ro"}},
	}
	for _, m := range extra {
		// nosuid,nodev spelled out: runc remounts an "ro" bind with the
		// flags listed here only, which would drop those of the source
		// mount (cubelet stages host mounts nosuid,nodev).
		opts := []string{"rbind", "rprivate", "nosuid", "nodev"}
		if m.ReadOnly {
			opts = append(opts, "ro")
		} else {
			opts = append(opts, "rw")
		}
		ms = append(ms, specs.Mount{Destination: m.Destination, Type: "bind", Source: m.Source, Options: opts})
	}
	return ms
}

func resourcesFor(l runtime.Limits) *specs.LinuxResources {
	r := Limits(l)
	r.Devices = defaultDevices()
	return r
}

// Limits is the CPU, memory and PID part of a sandbox's resources, what a
// running container's limits are updated to (runc update).
func Limits(l runtime.Limits) *specs.LinuxResources {
	r := &specs.LinuxResources{}
	if l.MilliCPU > 0 {
		quota := l.MilliCPU * int64(cfsPeriod) / 1000
		period := cfsPeriod
		r.CPU = &specs.LinuxCPU{Quota: &quota, Period: &period}
	}
	if l.MemoryMiB > 0 {
		limit := l.MemoryMiB << 20
		// Swap equal to the limit means "no swap": in OCI, swap is
		// memory+swap, and a sandbox silently swapping would make its
		// memory limit meaningless.
		swap := limit
		r.Memory = &specs.LinuxMemory{Limit: &limit, Swap: &swap}
	}
	if l.Pids > 0 {
		pids := l.Pids
		r.Pids = &specs.LinuxPids{Limit: &pids}
	}
	return r
}

// defaultDevices denies every device node, then allows the ones any
// userland expects (what runc creates in /dev plus the pty multiplexers).
func defaultDevices() []specs.LinuxDeviceCgroup {
	c := func(major, minor int64) specs.LinuxDeviceCgroup {
		return specs.LinuxDeviceCgroup{Allow: true, Type: "c", Major: &major, Minor: &minor, Access: "rwm"}
	}
	ptsMajor := int64(136)
	return []specs.LinuxDeviceCgroup{
		{Allow: false, Access: "rwm"},
		c(1, 3), // null
		c(1, 5), // zero
		c(1, 7), // full
		c(1, 8), // random
		c(1, 9), // urandom
		c(5, 0), // tty
		c(5, 2), // ptmx
		{Allow: true, Type: "c", Major: &ptsMajor, Access: "rwm"}, // /dev/pts/*
	}
}
