package vm

import (
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// kvmCreateVM is _IO(KVMIO, 0x01).
const kvmCreateVM = 0xAE01

// kvmWorks reports whether /dev/kvm opens and KVM_CREATE_VM succeeds: a
// /dev/kvm node alone is not enough (containers expose it without access,
// nested hosts without virtualisation support).
func kvmWorks() error {
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	fd, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), kvmCreateVM, 0)
	if errno != 0 {
		return fmt.Errorf("KVM_CREATE_VM: %w", errno)
	}
	return unix.Close(int(fd))
}

// hardwareVirt reports whether the host CPU advertises VT-x or AMD-V. Some
// hosts hand out a /dev/kvm on which KVM_CREATE_VM succeeds without it
// (seen on these CI machines): QEMU then aborts setting MSRs or the guest
// hangs in early boot, so auto does not trust such a KVM.
func hardwareVirt() bool {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "flags" {
			for _, f := range strings.Fields(v) {
				if f == "vmx" || f == "svm" {
					return true
				}
			}
			return false
		}
	}
	return false
}

// pickAccel resolves Config.Accel.
func pickAccel(want string) (string, error) {
	switch want {
	case "", "auto":
		if hardwareVirt() && kvmWorks() == nil {
			return "kvm", nil
		}
		return "tcg", nil
	case "kvm":
		if err := kvmWorks(); err != nil {
			return "", fmt.Errorf("vm: accel kvm: %w: %w", errdefs.ErrUnavailable, err)
		}
		return "kvm", nil
	case "tcg":
		return "tcg", nil
	}
	return "", fmt.Errorf("vm: accel %q: want auto, kvm or tcg: %w", want, errdefs.ErrInvalidArgument)
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}
