package main

import (
	"context"
	"crypto/rand"
	"fmt"
	"math/big"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/cubesandbox/cube/internal/vmguest"
)

// runtimeTOML is what cubelet's config needs for runtimeName beyond the
// runc defaults: lines for its [node] table (the default runtime) and
// tables of their own (for vm the guest artifacts, built once into the
// shared cache, and an agent-ready wait sized for TCG).
func runtimeTOML() (node, tables string, err error) {
	node = fmt.Sprintf("default_runtime = %q\n", runtimeName)
	if runtimeName == "gvisor" {
		if _, err := exec.LookPath("runsc"); err != nil {
			return "", "", fmt.Errorf("-runtime gvisor needs runsc (Debian package runsc): %w", err)
		}
		return node, "", nil
	}
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		return "", "", fmt.Errorf("-runtime vm needs qemu-system-x86_64 (Debian package qemu-system-x86): %w", err)
	}
	accel := os.Getenv("CUBE_VM_ACCEL")
	if accel == "" {
		accel = "tcg"
	}
	dir := filepath.Join(vmguest.DefaultCacheDir, "guest-e2e")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	if _, err := vmguest.Build(ctx, vmguest.BuildConfig{OutDir: dir}); err != nil {
		return "", "", fmt.Errorf("vm guest artifacts: %w", err)
	}
	return node, fmt.Sprintf("[vm]\nguest_dir = %q\naccel = %q\n[sandbox]\nagent_ready_timeout = \"180s\"\n", dir, accel), nil
}

// networkTOML is the run's network-agent config: a private link prefix
// and a random /24 in 10.192.0.0/10 (as the harness and the package
// tests pick theirs), so that it meets no other node on this host; the
// agent refuses an overlap. dns is the forwarder's upstream.
func networkTOML(prefix, dns, health string) string {
	v, _ := rand.Int(rand.Reader, big.NewInt(1<<14))
	a := uint32(10)<<24 | uint32(192)<<16 | uint32(v.Int64()<<8)
	cidr := netip.PrefixFrom(netip.AddrFrom4([4]byte{byte(a >> 24), byte(a >> 16), byte(a >> 8), byte(a)}), 24)
	size, vmSize := 4, 0
	if runtimeName == "vm" {
		size, vmSize = 0, 4
	}
	// Its health listener on a free port: another network-agent on this
	// host (a cube up, another run) may hold the default one. dns "": the
	// host's resolvers (/etc/resolv.conf; template builds resolve the
	// package mirrors with them, and their allow list admits only those).
	if health == "" {
		var err error
		if health, err = freeAddr(); err != nil {
			health = "127.0.0.1:0"
		}
	}
	upstreams := ""
	if dns != "" {
		upstreams = fmt.Sprintf("[dns]\nupstreams = [%q]\n", dns)
	}
	return fmt.Sprintf("node_cidr = %q\nprefix = %q\n[api]\nhttp = %q\n[pool]\nsize = %d\nvm_size = %d\n%s", cidr, prefix, health, size, vmSize, upstreams)
}
