package cubelet

// GvisorConfig configures the gvisor runtime driver ([gvisor]).
type GvisorConfig struct {
	// Binary is runsc; the driver is skipped when it cannot be found.
	Binary string `toml:"binary"`
	// Root is runsc --root; <run_dir>/runsc when empty.
	Root string `toml:"root"`
	// Platform is runsc --platform: ptrace (default, no KVM), kvm, systrap.
	Platform string `toml:"platform"`
	// Debug keeps runsc debug logs in each sandbox's bundle.
	Debug bool `toml:"debug"`
	// Checkpoint turns on memory snapshots (snapshot = checkpoint, clone
	// and rollback = restore). Off by default: Debian 12's runsc cannot
	// checkpoint a sandbox whose agent listens on TCP (docs/gvisor.md).
	Checkpoint bool `toml:"checkpoint"`
}
