package config

import (
	"fmt"
	"slices"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// WarmPoolConfig is [warm_pool]: sandboxes started ahead of creates, per
// template, and frozen until a create claims one (docs/pools.md).
type WarmPoolConfig struct {
	// Size is the entries kept per template (0 = no pool); Templates
	// overrides it for the templates it names.
	Size      int            `toml:"size"`
	Templates map[string]int `toml:"templates"`
	// Max bounds a pool grown by the recent create rate: a pool holds
	// between its size and Max entries, as many as creates of its
	// template claimed in the last RateWindow.
	Max        int      `toml:"max"`
	RateWindow Duration `toml:"rate_window"`
	// RefillInterval is the least time between two refills, all pools
	// together; a refill waits while any create is in flight.
	RefillInterval Duration `toml:"refill_interval"`
	// Runtimes are the runtimes pools are kept for.
	Runtimes []string `toml:"runtimes"`
}

// PoolRuntimes are the runtimes a warm pool can serve: a claim renames the
// frozen sandbox in place (hostname, the agent's identity through its
// reinit). A VM template keeps a pool only while it is warm: its entries
// are clones of the warm snapshot.
var PoolRuntimes = []string{"runc", "gvisor", "vm"}

// SizeFor is the configured pool size of template id.
func (w WarmPoolConfig) SizeFor(id string) int {
	if n, ok := w.Templates[id]; ok {
		return n
	}
	return w.Size
}

// On says whether any template has a pool.
func (w WarmPoolConfig) On() bool {
	if w.Size > 0 {
		return true
	}
	for _, n := range w.Templates {
		if n > 0 {
			return true
		}
	}
	return false
}

func (w *WarmPoolConfig) validate() error {
	bad := func(f string, a ...any) error {
		return fmt.Errorf("config: warm_pool: "+f+": %w", append(a, errdefs.ErrInvalidArgument)...)
	}
	if w.Size < 0 || w.Max < 0 {
		return bad("size and max must not be negative")
	}
	for id, n := range w.Templates {
		if n < 0 {
			return bad("templates.%s: %d is negative", id, n)
		}
		w.Max = max(w.Max, n)
	}
	w.Max = max(w.Max, w.Size)
	if w.RateWindow.Duration <= 0 || w.RefillInterval.Duration < 0 {
		return bad("rate_window must be positive and refill_interval not negative")
	}
	for _, r := range w.Runtimes {
		if !slices.Contains(PoolRuntimes, r) {
			return bad("runtime %q cannot keep a warm pool (supported: %v)", r, PoolRuntimes)
		}
	}
	return nil
}
