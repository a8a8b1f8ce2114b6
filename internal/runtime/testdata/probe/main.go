// Command probe tries one attack from inside a sandbox and says whether
// the kernel let it through. The runc and gvisor tests build it statically
// into their test rootfs (busybox has no keyctl, bpf or perf_event_open).
//
//	probe all         run every probe, one child process each, one line each
//	probe <name>      run one probe: "ok: ..." and exit 0, or
//	                  "refused: ..." and exit 1
//	probe euid        print the effective uid (the setuid row)
//	probe ftruncate F whether F (a console) can be truncated, to its own size
//
// Every probe stops at the first step that shows the attack would work
// (a file opened for writing is never written, a handle is closed): the
// same probe runs in deliberately unprotected controls.
package main

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"sort"
	"strings"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

var probes = map[string]func() (string, error){
	"keyctl": func() (string, error) {
		// uid 0's user keyring is shared with the host's root when
		// no user namespace separates them.
		id, err := unix.KeyctlGetKeyringID(unix.KEY_SPEC_USER_KEYRING, false)
		return fmt.Sprintf("user keyring %d", id), err
	},
	"add_key": func() (string, error) {
		id, err := unix.AddKey("user", "cube-probe", []byte("x"), unix.KEY_SPEC_PROCESS_KEYRING)
		return fmt.Sprintf("key %d", id), err
	},
	"bpf": func() (string, error) {
		// BPF_MAP_CREATE of a one-entry array map.
		attr := [5]uint32{unix.BPF_MAP_TYPE_ARRAY, 4, 4, 1, 0}
		fd, _, e := unix.Syscall(unix.SYS_BPF, unix.BPF_MAP_CREATE, uintptr(unsafe.Pointer(&attr[0])), unsafe.Sizeof(attr))
		if e != 0 {
			return "", e
		}
		unix.Close(int(fd))
		return "map created", nil
	},
	"perf_event_open": func() (string, error) {
		// A user-space-only software counter of this process: what
		// perf_event_paranoid=2 still allows anyone.
		attr := unix.PerfEventAttr{Type: unix.PERF_TYPE_SOFTWARE, Config: unix.PERF_COUNT_SW_CPU_CLOCK,
			Size: uint32(unsafe.Sizeof(unix.PerfEventAttr{})), Bits: unix.PerfBitDisabled | unix.PerfBitExcludeKernel | unix.PerfBitExcludeHv}
		fd, err := unix.PerfEventOpen(&attr, 0, -1, -1, unix.PERF_FLAG_FD_CLOEXEC)
		if err != nil {
			return "", err
		}
		unix.Close(fd)
		return "counter opened", nil
	},
	"userfaultfd": func() (string, error) {
		// UFFD_USER_MODE_ONLY (1): what vm.unprivileged_userfaultfd=0
		// still allows anyone.
		fd, _, e := unix.Syscall(unix.SYS_USERFAULTFD, unix.O_CLOEXEC|1, 0, 0)
		if e != 0 {
			return "", e
		}
		unix.Close(int(fd))
		return "userfaultfd opened", nil
	},
	"mount": func() (string, error) {
		dir, err := os.MkdirTemp("", "mnt")
		if err != nil {
			return "", err
		}
		defer os.Remove(dir)
		if err := unix.Mount("probe", dir, "tmpfs", 0, "size=1m"); err != nil {
			return "", err
		}
		_ = unix.Unmount(dir, unix.MNT_DETACH)
		return "tmpfs mounted", nil
	},
	"unshare-user-net": func() (string, error) {
		// unshare -Urn: a user namespace gives CAP_NET_ADMIN over a
		// fresh network namespace, nf_tables included. unshare(2)
		// runs in the forked child: CLONE_NEWUSER wants a
		// single-threaded caller.
		cmd := exec.Command("/proc/self/exe", "true")
		cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: unix.CLONE_NEWUSER | unix.CLONE_NEWNET}
		if out, err := cmd.CombinedOutput(); err != nil {
			return string(out), err
		}
		return "child in a new user+net namespace", nil
	},
	"clone-newuser": func() (string, error) {
		// clone(2) with CLONE_NEWUSER (Go's fork path uses clone, not
		// clone3, for this).
		cmd := exec.Command("/proc/self/exe", "true")
		cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: unix.CLONE_NEWUSER}
		if out, err := cmd.CombinedOutput(); err != nil {
			return string(out), err
		}
		return "child in a new user namespace", nil
	},
	"clone3": func() (string, error) {
		// A clone3 call the kernel would reject for its size: EINVAL
		// means the kernel saw it, ENOSYS that the filter answered
		// (and libc falls back to clone).
		var args [8]uint64
		_, _, e := unix.Syscall(unix.SYS_CLONE3, uintptr(unsafe.Pointer(&args[0])), 8, 0)
		if e == unix.EINVAL {
			return "reached the kernel (EINVAL for the size)", nil
		}
		return "", e
	},
	"setns": func() (string, error) {
		fd, err := unix.Open("/proc/self/ns/uts", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return "", err
		}
		defer unix.Close(fd)
		runtime.LockOSThread()
		if err := unix.Setns(fd, unix.CLONE_NEWUTS); err != nil {
			return "", err
		}
		return "setns into own uts namespace", nil
	},
	"open_by_handle_at": func() (string, error) {
		// The "shocker" escape: a file opened by handle, bypassing
		// the mount namespace's view.
		h, mountID, err := unix.NameToHandleAt(unix.AT_FDCWD, "/bin/busybox", 0)
		if err != nil {
			return "", fmt.Errorf("name_to_handle_at: %w", err)
		}
		_ = mountID
		root, err := unix.Open("/", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return "", err
		}
		defer unix.Close(root)
		fd, err := unix.OpenByHandleAt(root, h, unix.O_RDONLY|unix.O_CLOEXEC)
		if err != nil {
			return "", err
		}
		unix.Close(fd)
		return "file opened by handle", nil
	},
	"personality": func() (string, error) {
		// ADDR_NO_RANDOMIZE: turns off ASLR for what runs next.
		_, _, e := unix.Syscall(unix.SYS_PERSONALITY, 0x0040000, 0, 0) // ADDR_NO_RANDOMIZE
		if e != 0 {
			return "", e
		}
		return "ASLR off", nil
	},
	"vsock": func() (string, error) {
		fd, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return "", err
		}
		unix.Close(fd)
		return "AF_VSOCK socket", nil
	},
	"vsock-high": func() (string, error) {
		// The family with high bits set: the kernel reads an int, so this
		// is AF_VSOCK to it; a filter comparing all 64 bits would miss it.
		fd, _, e := unix.RawSyscall(unix.SYS_SOCKET, 1<<32|unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if e != 0 {
			return "", e
		}
		unix.Close(int(fd))
		return "AF_VSOCK socket through a family with high bits set", nil
	},
	"proc-sys": func() (string, error) { return openWrite("/proc/sys/kernel/core_pattern") },
	"sysrq":    func() (string, error) { return openWrite("/proc/sysrq-trigger") },
	"sys":      func() (string, error) { return openWrite("/sys/kernel/mm/transparent_hugepage/enabled") },
	"proc1-fd1": func() (string, error) {
		// Opened for writing only: the flood itself is the agent's
		// console file (a regular file on the host) growing without
		// bound. A PID 1 whose stdout is /dev/null offers nothing.
		f, err := os.OpenFile("/proc/1/fd/1", os.O_WRONLY, 0)
		if err != nil {
			return "", err
		}
		defer f.Close()
		st, err := f.Stat()
		if err != nil {
			return "", err
		}
		if !st.Mode().IsRegular() {
			return "", fmt.Errorf("PID 1's stdout is not the console file but %v", st.Mode().Type())
		}
		return fmt.Sprintf("console file opened for writing (%d bytes)", st.Size()), nil
	},
	"proc1-environ": func() (string, error) {
		b, err := os.ReadFile("/proc/1/environ")
		if err != nil {
			return "", err
		}
		return fmt.Sprintf("read %d bytes", len(b)), nil
	},
	"proc1-mem": func() (string, error) {
		// The agent's memory holds the sandbox's access token.
		f, err := os.Open("/proc/1/mem")
		if err != nil {
			return "", err
		}
		f.Close()
		return "opened", nil
	},
	"ptrace1": func() (string, error) {
		// PTRACE_SEIZE does not stop PID 1; detached right away.
		runtime.LockOSThread()
		if _, _, e := unix.Syscall6(unix.SYS_PTRACE, unix.PTRACE_SEIZE, 1, 0, 0, 0, 0); e != 0 {
			return "", e
		}
		_, _, _ = unix.Syscall6(unix.SYS_PTRACE, unix.PTRACE_DETACH, 1, 0, 0, 0, 0)
		return "attached to PID 1", nil
	},
	"interrupts": func() (string, error) { return readNonEmpty("/proc/interrupts") },
	"firmware": func() (string, error) {
		ents, err := os.ReadDir("/sys/firmware")
		if err != nil {
			return "", err
		}
		if len(ents) == 0 {
			return "", errors.New("empty (masked)")
		}
		return fmt.Sprintf("%d entries", len(ents)), nil
	},
}

func openWrite(path string) (string, error) {
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return "", err
	}
	f.Close()
	return "opened for writing", nil
}

func readNonEmpty(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	if len(b) == 0 {
		return "", errors.New("empty (masked)")
	}
	return fmt.Sprintf("read %d bytes", len(b)), nil
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: probe all|euid|<name>")
		os.Exit(2)
	}
	switch name := os.Args[1]; name {
	case "true":
		return
	case "euid":
		nnp := "?"
		if b, err := os.ReadFile("/proc/self/status"); err == nil {
			for line := range strings.Lines(string(b)) {
				if v, ok := strings.CutPrefix(line, "NoNewPrivs:"); ok {
					nnp = strings.TrimSpace(v)
				}
			}
		}
		fmt.Printf("uid=%d euid=%d nnp=%s\n", os.Getuid(), os.Geteuid(), nnp)
	case "ftruncate":
		f, err := os.OpenFile(os.Args[2], os.O_WRONLY|os.O_APPEND, 0)
		if err == nil {
			var st os.FileInfo
			if st, err = f.Stat(); err == nil {
				fmt.Printf("%s is %v, %d bytes; ", os.Args[2], st.Mode().Type(), st.Size())
				err = f.Truncate(st.Size())
			}
			f.Close()
		}
		if err != nil {
			fmt.Printf("refused: %v\n", err)
			os.Exit(1)
		}
		fmt.Println("ok: truncated")
	case "all":
		names := make([]string, 0, len(probes))
		for n := range probes {
			names = append(names, n)
		}
		sort.Strings(names)
		for _, n := range names {
			out, _ := exec.Command("/proc/self/exe", n).CombinedOutput()
			fmt.Printf("%s: %s\n", n, strings.TrimSpace(string(out)))
		}
	default:
		fn, ok := probes[name]
		if !ok {
			fmt.Fprintf(os.Stderr, "unknown probe %q\n", name)
			os.Exit(2)
		}
		what, err := fn()
		if err != nil {
			fmt.Printf("refused: %v %s\n", err, strings.TrimSpace(what))
			os.Exit(1)
		}
		fmt.Printf("ok: %s\n", what)
	}
}
