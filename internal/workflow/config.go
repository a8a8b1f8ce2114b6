package workflow

import (
	"fmt"
	"slices"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/tomlconfig"
)

// FlowConfig declares one flow. It decodes from TOML:
//
//	[flows.create]
//	limit = 10
//	steps = [["disk.clone", "net.slot"], ["disk.mount"], ["runtime.start"], ["agent.wait"]]
type FlowConfig struct {
	// Steps run in order; the actions inside one step run in parallel. At
	// least one step, no empty step, and an action at most once per flow.
	Steps [][]string `toml:"steps"`
	// Limit caps concurrent runs of the flow; 0 = unlimited.
	Limit int `toml:"limit"`
	// Queue is how long a run over the limit waits for a slot before it
	// fails with ResourceExhausted; 0 = it fails at once.
	Queue tomlconfig.Duration `toml:"queue"`
}

// Config maps flow (= verb) names to their declaration. The daemon embeds it
// under the "flows" table:
//
//	type DaemonConfig struct {
//		Flows workflow.Config `toml:"flows"`
//	}
type Config map[string]FlowConfig

// flow is one validated, resolved flow. It is immutable once built, except
// for the shared limiter.
type flow[T any] struct {
	name    string
	verb    *Verb[T]
	steps   [][]Action
	names   [][]string
	queue   time.Duration
	limiter *limiter
}

// build validates cfg against the verbs and the registry and resolves the
// actions. It does not touch limiters.
func build[T any](reg *Registry, verbs map[string]*Verb[T], cfg Config) (map[string]*flow[T], error) {
	flows := make(map[string]*flow[T], len(cfg))
	names := make([]string, 0, len(cfg))
	for n := range cfg {
		names = append(names, n)
	}
	slices.Sort(names) // deterministic first error
	for _, name := range names {
		fc := cfg[name]
		bad := func(format string, args ...any) error {
			return fmt.Errorf("workflow: flow %q"+format+": %w", append(append([]any{name}, args...), errdefs.ErrInvalidArgument)...)
		}
		v, ok := verbs[name]
		if !ok {
			return nil, bad(": no verb of that name (verbs: %v)", sortedKeys(verbs))
		}
		if fc.Limit < 0 {
			return nil, bad(": negative limit %d", fc.Limit)
		}
		if fc.Queue.Duration < 0 {
			return nil, bad(": negative queue %s", fc.Queue.Duration)
		}
		if len(fc.Steps) == 0 {
			return nil, bad(": no steps")
		}
		f := &flow[T]{name: name, verb: v, steps: make([][]Action, len(fc.Steps)), names: make([][]string, len(fc.Steps)), queue: fc.Queue.Duration}
		seen := map[string]int{}
		for i, step := range fc.Steps {
			if len(step) == 0 {
				return nil, bad(" step %d: empty step", i+1)
			}
			for _, an := range step {
				if prev, dup := seen[an]; dup {
					return nil, bad(" step %d: duplicate action %q (already in step %d)", i+1, an, prev)
				}
				seen[an] = i + 1
				a, ok := reg.Lookup(an)
				if !ok {
					return nil, bad(" step %d: unknown action %q", i+1, an)
				}
				if !v.supports(a) {
					return nil, bad(" step %d: action %q (%T) does not support verb %q", i+1, an, a, name)
				}
				f.steps[i] = append(f.steps[i], a)
			}
			f.names[i] = slices.Clone(step)
		}
		flows[name] = f
	}
	return flows, nil
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}
