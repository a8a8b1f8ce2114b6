package vm

import (
	"testing"

	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/runtimetest"
)

// TestConformance runs the driver contract with the real guest: Start
// returns once QEMU runs, so the suite's ten concurrent starts cost ten
// QEMU launches, not ten guest boots to the agent.
func TestConformance(t *testing.T) {
	requireVM(t)
	envs := map[*testing.T]*testEnv{}
	runtimetest.Run(t,
		func(t *testing.T) runtime.Driver {
			e := newEnv(t)
			envs[t] = e
			return e.d
		},
		func(t *testing.T, id string) runtime.Spec { return envs[t].spec(t, id) },
	)
}
