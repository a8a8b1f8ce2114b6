package ocispec

import (
	goruntime "runtime"
	"slices"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// hostArch picks the seccomp architectures. It is a variable so that the
// golden files, written on amd64, stay valid on other builders.
var hostArch = goruntime.GOARCH

// nsFlags are clone/unshare flags that create namespaces: a fresh user
// namespace hands its creator every capability over it, which is the
// entry point of most container-to-host kernel exploits (nf_tables,
// overlayfs, ...). CLONE_NEWTIME shares its bit with clone's exit signal,
// so only unshare is checked for it (clone3 is refused outright).
const (
	nsFlags = unix.CLONE_NEWNS | unix.CLONE_NEWCGROUP | unix.CLONE_NEWUTS | unix.CLONE_NEWIPC |
		unix.CLONE_NEWUSER | unix.CLONE_NEWPID | unix.CLONE_NEWNET
	unshareNSFlags = nsFlags | unix.CLONE_NEWTIME
)

// allowedSyscalls is everything a sandbox may call without argument
// checks, for the native ABI. It follows the shape of the default profile
// Docker and containerd ship (ordinary Linux userland: files, sockets,
// signals, timers, IPC, threads, memory, credentials as the kernel checks
// them) and leaves out, on purpose:
//
//   - keyctl, add_key, request_key: the kernel keyring is not namespaced;
//     uid 0 in a sandbox would share root's user keyring with the host.
//   - bpf, perf_event_open, userfaultfd, io_uring_*: large kernel attack
//     surface and a long record of privilege-escalation bugs; nothing a
//     sandboxed program needs (language runtimes fall back from io_uring).
//   - mount, umount2, pivot_root, move_mount, open_tree, fsopen, fsconfig,
//     fsmount, fspick, mount_setattr, setns, and namespace flags of
//     clone/unshare: cube-agent mounts nothing in a container (only as a
//     VM's PID 1, where no filter applies), and new namespaces are the
//     way to capabilities the sandbox does not have.
//   - open_by_handle_at: opens files by handle, bypassing the mount
//     namespace (the "shocker" escape); name_to_handle_at stays, it only
//     reads a handle.
//   - kexec_*, init_module, finit_module, delete_module, reboot, swapon,
//     swapoff, acct, quotactl, syslog, settimeofday, clock_settime,
//     sethostname, setdomainname, iopl, ioperm, modify_ldt,
//     lookup_dcookie, vhangup, fanotify_init, mbind and the mempolicy
//     calls: host-wide state or hardware a sandbox never owns (adjtimex
//     and clock_adjtime stay: the kernel refuses their writes without
//     CAP_SYS_TIME, and time daemons read the clock state through them).
//   - the 32-bit compat ABIs (x86, x32, arm): see seccompArches.
//
// ptrace, process_vm_readv/writev, kcmp and pidfd_getfd stay: the kernel
// limits them to processes in the sandbox's own PID namespace that the
// caller may trace (kernels >= 4.8 re-check seccomp after a tracer's
// changes), and debuggers and profilers need them. cube-agent makes itself
// non-dumpable, so even root in the sandbox cannot trace or read it.
var allowedSyscalls = []string{
	"accept", "accept4", "access", "adjtimex", "alarm", "arch_prctl", "bind", "brk",
	"cachestat", "capget", "capset", "chdir", "chmod", "chown", "chroot",
	"clock_adjtime", "clock_getres", "clock_gettime", "clock_nanosleep", "close", "close_range",
	"connect", "copy_file_range", "creat", "dup", "dup2", "dup3",
	"epoll_create", "epoll_create1", "epoll_ctl", "epoll_pwait", "epoll_pwait2", "epoll_wait",
	"eventfd", "eventfd2", "execve", "execveat", "exit", "exit_group",
	"faccessat", "faccessat2", "fadvise64", "fallocate", "fanotify_mark",
	"fchdir", "fchmod", "fchmodat", "fchmodat2", "fchown", "fchownat", "fcntl",
	"fdatasync", "fgetxattr", "flistxattr", "flock", "fork", "fremovexattr",
	"fsetxattr", "fstat", "fstatfs", "fsync", "ftruncate",
	"futex", "futex_requeue", "futex_wait", "futex_waitv", "futex_wake", "futimesat",
	"get_robust_list", "getcpu", "getcwd", "getdents", "getdents64",
	"getegid", "geteuid", "getgid", "getgroups", "getitimer", "getpeername",
	"getpgid", "getpgrp", "getpid", "getppid", "getpriority", "getrandom",
	"getresgid", "getresuid", "getrlimit", "getrusage", "getsid",
	"getsockname", "getsockopt", "gettid", "gettimeofday", "getuid", "getxattr",
	"inotify_add_watch", "inotify_init", "inotify_init1", "inotify_rm_watch",
	"io_cancel", "io_destroy", "io_getevents", "io_pgetevents", "io_setup", "io_submit",
	"ioctl", "ioprio_get", "ioprio_set", "kcmp", "kill",
	"landlock_add_rule", "landlock_create_ruleset", "landlock_restrict_self",
	"lchown", "lgetxattr", "link", "linkat", "listen", "listxattr", "llistxattr",
	"lremovexattr", "lseek", "lsetxattr", "lstat",
	"madvise", "map_shadow_stack", "membarrier", "memfd_create", "memfd_secret",
	"mincore", "mkdir", "mkdirat", "mknod", "mknodat",
	"mlock", "mlock2", "mlockall", "mmap", "mprotect",
	"mq_getsetattr", "mq_notify", "mq_open", "mq_timedreceive", "mq_timedsend", "mq_unlink",
	"mremap", "mseal", "msgctl", "msgget", "msgrcv", "msgsnd", "msync",
	"munlock", "munlockall", "munmap", "name_to_handle_at", "nanosleep", "newfstatat",
	"open", "openat", "openat2", "pause", "pidfd_getfd", "pidfd_open", "pidfd_send_signal",
	"pipe", "pipe2", "pkey_alloc", "pkey_free", "pkey_mprotect", "poll", "ppoll", "prctl",
	"pread64", "preadv", "preadv2", "prlimit64", "process_mrelease",
	"process_vm_readv", "process_vm_writev", "pselect6", "ptrace",
	"pwrite64", "pwritev", "pwritev2", "read", "readahead", "readlink", "readlinkat", "readv",
	"recvfrom", "recvmmsg", "recvmsg", "remap_file_pages", "removexattr",
	"rename", "renameat", "renameat2", "restart_syscall", "rmdir", "rseq",
	"rt_sigaction", "rt_sigpending", "rt_sigprocmask", "rt_sigqueueinfo", "rt_sigreturn",
	"rt_sigsuspend", "rt_sigtimedwait", "rt_tgsigqueueinfo",
	"sched_get_priority_max", "sched_get_priority_min", "sched_getaffinity", "sched_getattr",
	"sched_getparam", "sched_getscheduler", "sched_rr_get_interval", "sched_setaffinity",
	"sched_setattr", "sched_setparam", "sched_setscheduler", "sched_yield",
	"seccomp", "select", "semctl", "semget", "semop", "semtimedop",
	"sendfile", "sendmmsg", "sendmsg", "sendto",
	"set_robust_list", "set_tid_address", "setfsgid", "setfsuid", "setgid", "setgroups",
	"setitimer", "setpgid", "setpriority", "setregid", "setresgid", "setresuid",
	"setreuid", "setrlimit", "setsid", "setsockopt", "setuid", "setxattr",
	"shmat", "shmctl", "shmdt", "shmget", "shutdown", "sigaltstack",
	"signalfd", "signalfd4", "socketpair", "splice", "stat", "statfs", "statx",
	"symlink", "symlinkat", "sync", "sync_file_range", "syncfs", "sysinfo",
	"tee", "tgkill", "time", "timer_create", "timer_delete", "timer_getoverrun",
	"timer_gettime", "timer_settime", "timerfd_create", "timerfd_gettime", "timerfd_settime",
	"times", "tkill", "truncate", "umask", "uname", "unlink", "unlinkat",
	"utime", "utimensat", "utimes", "vfork", "vmsplice", "wait4", "waitid", "write", "writev",
}

// amd64Only are in allowedSyscalls but exist on amd64 only (the thread
// pointer); other architectures' profiles leave them out.
var amd64Only = []string{"arch_prctl"}

// personalities are the personality(2) values a sandbox may set: Linux,
// UNAME26 (old build scripts), their 32-bit forms, and the query value.
// Others (ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC, ...) weaken the address
// space layout of whatever the caller runs next.
var personalities = []uint64{0x0, 0x0008, 0x20000, 0x20008, 0xffffffff}

// seccompArches lists only the native ABI. The 32-bit compat layers are a
// recurring source of kernel bugs, and on x86 their socketcall(2)
// multiplexer hides the socket family from the filter (which would reopen
// AF_VSOCK); 32-bit binaries are not what sandboxes run.
func seccompArches(goarch string) []specs.Arch {
	switch goarch {
	case "amd64":
		return []specs.Arch{specs.ArchX86_64}
	case "arm64":
		return []specs.Arch{specs.ArchAARCH64}
	}
	return nil // the runtime's native architecture only
}

// socketFamilies are the address families socket(2) may create:
// local sockets, IPv4/IPv6, netlink (routing queries by libc and
// language runtimes) and packet sockets (useless without CAP_NET_RAW,
// which sandboxes lack, but harmless to ask for).
var socketFamilies = []uint64{unix.AF_UNIX, unix.AF_INET, unix.AF_INET6, unix.AF_NETLINK, unix.AF_PACKET}

// seccompProfile is the filter every process of a runc sandbox runs
// under: allowedSyscalls plus argument-checked clone, unshare, socket
// and personality; everything else fails with EPERM, except clone3,
// which fails with ENOSYS so that glibc and others fall back to clone,
// where the namespace flags can be checked (clone3 passes them in
// memory the filter cannot read).
func seccompProfile(goarch string) *specs.LinuxSeccomp {
	eperm := uint(unix.EPERM)
	enosys := uint(unix.ENOSYS)
	names := slices.DeleteFunc(slices.Clone(allowedSyscalls), func(n string) bool {
		return goarch != "amd64" && slices.Contains(amd64Only, n)
	})
	sc := &specs.LinuxSeccomp{
		DefaultAction:   specs.ActErrno,
		DefaultErrnoRet: &eperm,
		Architectures:   seccompArches(goarch),
		Syscalls: []specs.LinuxSyscall{
			{Names: names, Action: specs.ActAllow},
			{Names: []string{"clone"}, Action: specs.ActAllow, Args: []specs.LinuxSeccompArg{
				{Index: 0, Value: nsFlags, ValueTwo: 0, Op: specs.OpMaskedEqual},
			}},
			{Names: []string{"unshare"}, Action: specs.ActAllow, Args: []specs.LinuxSeccompArg{
				{Index: 0, Value: unshareNSFlags, ValueTwo: 0, Op: specs.OpMaskedEqual},
			}},
			{Names: []string{"clone3"}, Action: specs.ActErrno, ErrnoRet: &enosys},
		},
	}
	// socket: only the families programs in a sandbox use. The kernel
	// reads the family as an int, the filter all 64 bits: each rule
	// compares the low 32 bits alone, so high bits set by a raw syscall
	// cannot slip another family past it. Out are, among others,
	// AF_VSOCK (not network-namespaced: it reaches the host's and VM
	// sandboxes' vsock services, the agent channel included) and AF_ALG
	// (the kernel crypto API, a recurring source of kernel bugs).
	for _, fam := range socketFamilies {
		sc.Syscalls = append(sc.Syscalls, specs.LinuxSyscall{
			Names: []string{"socket"}, Action: specs.ActAllow,
			Args: []specs.LinuxSeccompArg{{Index: 0, Value: 0xffffffff, ValueTwo: fam, Op: specs.OpMaskedEqual}},
		})
	}
	for _, p := range personalities {
		sc.Syscalls = append(sc.Syscalls, specs.LinuxSyscall{
			Names: []string{"personality"}, Action: specs.ActAllow,
			Args: []specs.LinuxSeccompArg{{Index: 0, Value: p, Op: specs.OpEqualTo}},
		})
	}
	return sc
}
