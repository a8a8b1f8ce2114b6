package ocispec

import (
	"slices"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// TestSeccompProfileRefuses pins the calls the filter exists to refuse:
// none may reach the allow-list, on either architecture, and the
// argument-checked ones are allowed only under their condition.
func TestSeccompProfileRefuses(t *testing.T) {
	never := []string{
		"keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
		"io_uring_setup", "io_uring_enter", "io_uring_register",
		"mount", "umount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen",
		"fsconfig", "fsmount", "fspick", "mount_setattr", "setns", "open_by_handle_at",
		"kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
		"reboot", "swapon", "swapoff", "acct", "quotactl", "syslog", "settimeofday",
		"clock_settime", "sethostname", "setdomainname", "iopl", "ioperm", "modify_ldt",
		"socketcall", "fanotify_init", "lookup_dcookie", "vhangup", "mbind", "set_mempolicy",
	}
	for _, arch := range []string{"amd64", "arm64"} {
		p := seccompProfile(arch)
		if p.DefaultAction != specs.ActErrno || p.DefaultErrnoRet == nil || *p.DefaultErrnoRet != 1 {
			t.Errorf("%s: default %v/%v, want EPERM", arch, p.DefaultAction, p.DefaultErrnoRet)
		}
		seen := map[string]bool{}
		for _, sc := range p.Syscalls {
			for _, n := range sc.Names {
				if slices.Contains(never, n) {
					t.Errorf("%s: %s is in the profile (%s)", arch, n, sc.Action)
				}
				if sc.Action == specs.ActAllow && len(sc.Args) == 0 {
					if seen[n] {
						t.Errorf("%s: %s listed twice", arch, n)
					}
					seen[n] = true
					if slices.Contains([]string{"clone", "clone3", "unshare", "socket", "personality"}, n) {
						t.Errorf("%s: %s allowed without its argument check", arch, n)
					}
				}
			}
		}
		if arch == "arm64" && seen["arch_prctl"] {
			t.Errorf("arm64 profile allows amd64's arch_prctl")
		}
	}
	if got := seccompArches("arm64"); !slices.Equal(got, []specs.Arch{specs.ArchAARCH64}) {
		t.Errorf("arm64 arches %v", got)
	}
	if got := seccompArches("amd64"); !slices.Equal(got, []specs.Arch{specs.ArchX86_64}) {
		t.Errorf("amd64 arches %v", got)
	}
}
