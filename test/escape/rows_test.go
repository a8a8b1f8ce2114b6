package escape

// The suite's table: every attempt, what stops it, and what each runtime
// is expected to show. A row is "blocked" in a runtime unless its expect
// entry says otherwise:
//
//   - NA: not an escape in this runtime, with why (the guest kernel or
//     the sentry is the boundary, the host never sees the object). The
//     probe still runs where it is cheap and its result is logged; the
//     costly ones (the bombs, the host-mount rows) are not run there.
//   - Pending: the control that blocks it lives on the named branch and
//     is not merged yet. An escape is reported as "pending:<branch>", not
//     failed; once merged, the entry goes (a pending row that is already
//     blocked is flagged in the table so the marker is not forgotten).
//
// Every row has a control (see controls in escape_test.go): the same
// probe succeeding where the one protection is absent, so a probe that
// cannot succeed does not count.

const (
	runc   = "runc"
	gvisor = "gvisor"
	vm     = "vm"
	// gvisor2 is a second gVisor sandbox, made for the memory bomb: the
	// first does not survive its fork bomb.
	gvisor2 = "gvisor-2"
)

var runtimes = []string{runc, gvisor, vm}

type expect struct {
	NA      string // why this is not an escape in this runtime
	Pending string // branch that brings the control
}

type row struct {
	Name    string
	Attempt string
	Stops   string // the control that stops it
	Control string // what the control case shows
	Expect  map[string]expect
}

const (
	guestKernel = "the guest kernel is the boundary: the attempt reaches only the VM's own kernel"
	guestDisk   = "the VM's disk is never mounted on the host: nothing planted in it is reachable there"
	sentry      = "the gVisor sentry implements this itself; the host kernel object is never reached"
)

var table = []row{
	{Name: "userns", Attempt: "clone(CLONE_NEWUSER|CLONE_NEWNET), then CAP_NET_ADMIN in the new netns (lo up): the nf_tables attack surface",
		Stops: "no nested user namespaces (userns ban / seccomp)", Control: "host root: the same probe works",
		Expect: map[string]expect{gvisor: {NA: sentry + " (the sentry's netstack has no nf_tables)"}, vm: {NA: guestKernel}}},
	{Name: "keyctl", Attempt: "keyctl(KEYCTL_GET_KEYRING_ID, user keyring): the host kernel's keyrings",
		Stops: "seccomp denies keyctl/add_key", Control: "host root: the same probe reaches its keyring",
		Expect: map[string]expect{vm: {NA: guestKernel}}},
	{Name: "mount", Attempt: "mount(tmpfs) inside the sandbox",
		Stops: "no CAP_SYS_ADMIN", Control: "host root in a new mount namespace: the same probe mounts",
		Expect: map[string]expect{vm: {NA: guestKernel}}},
	{Name: "bpf", Attempt: "bpf(BPF_MAP_CREATE)",
		Stops: "no CAP_BPF/CAP_SYS_ADMIN (kernel.unprivileged_bpf_disabled)", Control: "host root: the same probe creates a map",
		Expect: map[string]expect{vm: {NA: guestKernel}}},
	{Name: "ptrace-host", Attempt: "find a host process by its argv marker and PTRACE_SEIZE it",
		Stops: "PID namespace: host processes are not visible", Control: "the same probe on the host finds and attaches it",
		Expect: map[string]expect{}},
	{Name: "ptrace-agent", Attempt: "PTRACE_SEIZE the agent (PID 1) and read /proc/1/environ",
		Stops: "the agent is non-dumpable", Control: "the same attach works on a dumpable process of the same uid (host)",
		Expect: map[string]expect{gvisor: {NA: "the sentry refuses the attach; runsc ignores dumpability for /proc/1/environ, which holds only the environment every command gets (docs/security.md)"}, vm: {NA: guestKernel}}},
	{Name: "proc1-fd1", Attempt: "write to the agent's stdout through /proc/1/fd/1 (an unbounded host file for runc)",
		Stops: "runc: the agent is non-dumpable; gVisor (whose sentry ignores dumpability): the agent's stdout is /dev/null once it listens, so nothing reaches the host's console.log", Control: "host: the same write through /proc/PID/fd/1 of a dumpable process works",
		Expect: map[string]expect{vm: {NA: "PID 1's stdout is the guest console: the host keeps a fixed-size ring (TestVMSandboxes)"}}},
	{Name: "proc-sys", Attempt: "write a host-wide sysctl (/proc/sys/kernel/printk_ratelimit, same value)",
		Stops: "/proc/sys read-only", Control: "host root: the same write works",
		Expect: map[string]expect{vm: {NA: guestKernel}}},
	{Name: "sys", Attempt: "write a host-wide sysfs attribute (/sys/kernel/mm/ksm/run, same value)",
		Stops: "/sys read-only", Control: "host root: the same write works",
		Expect: map[string]expect{vm: {NA: guestKernel}}},
	{Name: "agent-binary", Attempt: "chmod the shared agent binary (a write to the host's file)",
		Stops: "read-only bind of the node's cube-agent", Control: "host root: the same chmod of that file works",
		Expect: map[string]expect{vm: {NA: "a VM runs its template's own copy of the agent, on its own disk"}}},
	{Name: "raw-spoof", Attempt: "raw socket: TCP SYN, UDP and ICMP from a forged source to a capture in the world",
		Stops: "no CAP_NET_RAW; the slot drops foreign sources (anti-spoofing)", Control: "in the runc sandbox's netns as host root: own source arrives; forged arrives with the anti-spoofing rule deleted",
		Expect: map[string]expect{}},
	{Name: "setuid-host", Attempt: "plant a setuid-root copy of the probe at the sandbox's /, exec it from the host as nobody",
		Stops: "sandbox rootfs under a 0700 run directory", Control: "with the run directory at 0711 nobody reaches and runs it",
		Expect: map[string]expect{vm: {NA: guestDisk}}},
	{Name: "nosuid", Attempt: "the planted setuid file, reached by nobody through a loosened run directory, gives euid 0",
		Stops: "the rootfs mount is nosuid,nodev", Control: "the same file copied to a host directory without nosuid gives euid 0",
		Expect: map[string]expect{vm: {NA: guestDisk}}},
	{Name: "mknod", Attempt: "mknod c 1 1 (/dev/mem) at the sandbox's /",
		Stops: "no CAP_MKNOD", Control: "host root: the same mknod works",
		Expect: map[string]expect{vm: {NA: guestDisk}}},
	{Name: "ipv6", Attempt: "ICMPv6 echo to ff02::1 on eth0 (any IPv6 answer is a path the IPv4 rules do not see)",
		Stops: "IPv6 disabled in the slot's namespaces; ip6 tables drop everything from slots", Control: "runc slot with IPv6 enabled and the ip6 rules removed: the same probe gets an answer",
		Expect: map[string]expect{}},
	{Name: "fork-bomb", Attempt: "start processes until fork fails (up to 320, limit 256)",
		Stops: "pids cgroup limit", Control: "runc: the probe forks up to the limit and the host cgroup counts the refusal",
		Expect: map[string]expect{
			gvisor: {NA: "guest tasks are the sentry's, not host processes: the pids limit bounds the sentry's host threads, its memory limit the tasks"},
			vm:     {NA: guestKernel + " (its vCPUs and RAM are fixed)"}}},
	{Name: "memory-bomb", Attempt: "allocate and touch 1 GiB (limit 256 MiB)",
		Stops: "memory cgroup limit, no swap beyond it", Control: "the same probe with 64 MiB completes",
		Expect: map[string]expect{vm: {NA: guestKernel + " (its RAM is fixed)"}}},
	{Name: "disk-fill", Attempt: "write the root filesystem until ENOSPC",
		Stops: "the ext4 image's size is the quota", Control: "the sandbox's image file grew with the writes (they land in the host pool)",
		Expect: map[string]expect{}},
	{Name: "inotify", Attempt: "take inotify instances until refused (at most 8192) and hold them while host root calls inotify_init",
		Stops: "per-sandbox inotify limits (user namespace)", Control: "the same probe on the host gets the host's ceiling (or the cap)",
		Expect: map[string]expect{gvisor: {NA: sentry}, vm: {NA: guestKernel}}},
	{Name: "ro-bind", Attempt: "create a file in a host directory bound read-only (/ro)",
		Stops: "the bind is read-only", Control: "host root: the same create in that directory works",
		Expect: map[string]expect{vm: {NA: "a VM gets no host mounts"}}},
	{Name: "ro-submount", Attempt: "create a file in a mount below the read-only bind (/ro/sub, a tmpfs on the host)",
		Stops: "read-only binds are read-only recursively", Control: "host root: the same create in that mount works",
		Expect: map[string]expect{vm: {NA: "a VM gets no host mounts"}}},
	{Name: "symlink-swap", Attempt: "a sandbox with a rw host mount swaps a directory for a symlink to a secret after cubelet checked another sandbox's bind source at its request, before its container is made",
		Stops: "the source is checked again where it is bound and bound by descriptor (openat2 without symlinks, open_tree clone)", Control: "by name, the checked path now leads to the secret",
		Expect: map[string]expect{vm: {NA: "a VM gets no host mounts"}}},
}

// Network rows: one per target and protocol. "internet" is the positive
// control run in every runtime: the world answers when the policy allows,
// so silence elsewhere is the rules' doing.
var netTargets = []struct{ Name, What, Stops string }{
	{"host", "the host's own address (its end of the world link)", "host table: input from slot links dropped"},
	{"gateway", "the host end of the sandbox's own slot link", "slot: node CIDR blocked; host table: input from slot links dropped"},
	{"neighbour", "another sandbox's slot address", "slot: node CIDR blocked; host table: slot-to-slot forward dropped; the neighbour's slot accepts only its gateway"},
	{"metadata", "169.254.169.254 (a responder in the world)", "slot: 169.254.0.0/16 blocked"},
	{"private", "an address in a private range (172.31.255.0/24 in the world)", "slot: private ranges closed unless the operator opens them"},
	{"node", "another node's LAN address (172.31.254.0/24, a range no operator opened)", "slot: private ranges closed unless the operator opens them"},
}

var protocols = []string{"tcp", "udp", "icmp"}

func init() {
	for _, tg := range netTargets {
		for _, p := range protocols {
			ctl := "runc slot with its blocked/private sets flushed and the host table removed: the same probe gets an answer"
			if tg.Name == "neighbour" {
				ctl = "with also the neighbour's slot table removed (three layers stop it: the sender's slot, the host table, the neighbour's slot), the same probe gets an answer from the neighbour's slot"
			}
			table = append(table, row{Name: tg.Name + "-" + p, Attempt: p + " to " + tg.What, Stops: tg.Stops, Control: ctl,
				Expect: map[string]expect{}})
		}
	}
}
