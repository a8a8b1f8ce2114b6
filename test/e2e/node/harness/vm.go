package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/vmguest"
)

// vmGuestDir is where the harness keeps its guest artifacts: built once
// (a kernel package download, then cached until the metapackage moves),
// next to the ones the cubelet tests use.
var vmGuestDir = filepath.Join(vmguest.DefaultCacheDir, "guest-e2e")

// startVM prepares what the vm runtime needs (QEMU, the guest kernel and
// initramfs, a network-agent for the VM's slot) and returns the cubelet
// config lines for it; for gvisor only the network-agent (a gVisor
// sandbox's agent is reachable only through its slot too). CUBE_VM_ACCEL picks the accelerator (tcg by
// default: what hosts without KVM run, and the slow case the suite must
// fit; "auto" uses KVM where it works).
func (n *node) startVM(ctx context.Context) (string, error) {
	na, err := startNetAgent(ctx, n.runtime, n.log)
	if err != nil {
		return "", err
	}
	n.net = na
	network := fmt.Sprintf("[network]\nagent_socket = %q\n", na.cfg.API.Socket)
	if n.runtime == "gvisor" {
		if _, err := exec.LookPath("runsc"); err != nil {
			return "", fmt.Errorf("-runtime gvisor needs runsc (Debian package runsc): %w", err)
		}
		return network, nil
	}
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		return "", fmt.Errorf("-runtime vm needs qemu-system-x86_64 (Debian package qemu-system-x86): %w", err)
	}
	accel := os.Getenv("CUBE_VM_ACCEL")
	switch accel {
	case "":
		accel = "tcg"
	case "tcg", "kvm", "auto":
	default:
		// cubelet would only skip the driver, and the create then fail
		// with "runtime vm is not available": say why here.
		return "", fmt.Errorf("CUBE_VM_ACCEL=%q: want tcg, kvm or auto: %w", accel, errdefs.ErrInvalidArgument)
	}
	if _, err := vmguest.Build(ctx, vmguest.BuildConfig{OutDir: vmGuestDir, Log: n.log}); err != nil {
		return "", fmt.Errorf("vm guest artifacts: %w", err)
	}
	// A TCG boot took about 4 s on an idle 2-core host, but the guest
	// only runs when QEMU's one TCG thread gets a core: the default
	// agent-ready wait is sized for containers.
	return fmt.Sprintf("[vm]\nguest_dir = %q\naccel = %q\n[sandbox]\nagent_ready_timeout = \"180s\"\n%s",
		vmGuestDir, accel, network), nil
}

// killQEMU is forceClean's part for VMs: a daemonized QEMU whose QMP
// socket lies under run (a delete that failed) is killed by pid.
func killQEMU(run string) {
	procs, _ := os.ReadDir("/proc")
	for _, e := range procs {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		cmd, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && strings.Contains(string(cmd), "unix:"+run+"/") {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}
