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
}
