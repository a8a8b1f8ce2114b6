package cubelet

// VMConfig configures the vm runtime driver ([vm]): QEMU micro-VMs.
type VMConfig struct {
	// Enabled registers the driver when QEMU and the guest artifacts are
	// found; false skips it.
	Enabled bool `toml:"enabled"`
	// QEMU is the emulator binary; the driver is skipped when missing.
	QEMU string `toml:"qemu"`
	// GuestDir holds the guest kernel and initramfs (go run ./hack/vm-guest).
	GuestDir string `toml:"guest_dir"`
	// Accel: auto (KVM when /dev/kvm works, else TCG), kvm or tcg.
	Accel string `toml:"accel"`
	// Root is the driver's state directory; <run_dir>/vm when empty.
	Root string `toml:"root"`
	// Vhost asks for vhost-net on the TAP, honoured where /dev/vhost-net
	// exists (QEMU aborts with vhost=on elsewhere).
	Vhost bool `toml:"vhost"`
}
